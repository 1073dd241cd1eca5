//! Page buffers reused between transfers. A received page is read into a buffer of its size
//! from here (no allocation, and no page faults once the buffers are warm: a fresh buffer per
//! page costs more than the copy itself), and the engine gives the buffers back once it has
//! written the pages into its pool. At most [`MAX_FREE_BYTES`] wait here.

use std::sync::Mutex;

/// The most bytes of free buffers kept (beyond that, given-back buffers are freed).
pub const MAX_FREE_BYTES: usize = 256 << 20;

static FREE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn free_list() -> std::sync::MutexGuard<'static, Vec<Vec<u8>>> {
    // A panic elsewhere while the list was held left it whole (push/pop only).
    FREE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A buffer of exactly `len` bytes, whose contents are whatever it held before (the caller
/// overwrites all of them).
pub fn page_buffer(len: usize) -> Vec<u8> {
    let mut free = free_list();
    if let Some(i) = free.iter().rposition(|b| b.len() == len) {
        return free.swap_remove(i);
    }
    drop(free);
    vec![0u8; len]
}

/// Gives page buffers back for later transfers.
pub fn recycle(pages: impl IntoIterator<Item = Vec<u8>>) {
    let mut free = free_list();
    let mut bytes: usize = free.iter().map(Vec::len).sum();
    for p in pages {
        if bytes + p.len() > MAX_FREE_BYTES {
            break;
        }
        bytes += p.len();
        free.push(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_bytes() -> usize {
        free_list().iter().map(Vec::len).sum()
    }

    #[test]
    fn buffers_come_back_by_size_and_the_free_list_is_bounded() {
        let a = page_buffer(1000);
        assert_eq!(a.len(), 1000);
        let ptr = a.as_ptr();
        let before = free_bytes();
        recycle([a, vec![0; 10]]);
        assert_eq!(free_bytes(), before + 1010);
        let again = page_buffer(1000);
        assert_eq!(again.as_ptr(), ptr, "the same buffer again");
        assert_eq!(page_buffer(10).len(), 10);
        recycle((0..300).map(|_| vec![0u8; 1 << 20]));
        assert!(free_bytes() <= MAX_FREE_BYTES);
        while free_bytes() > 0 {
            let n = free_list().last().map_or(0, Vec::len);
            page_buffer(n);
        }
    }
}
