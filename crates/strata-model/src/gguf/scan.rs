//! A bounds-checking walk over a GGUF header before any reader allocates for it.
//!
//! A GGUF header is lengths and counts (strings, arrays, metadata entries, tensor infos). A
//! hostile file can state a 1 TiB string or a 2^40-element array in a few bytes; a reader that
//! allocates what the header states then aborts the process. This walk checks every count and
//! length against the bytes left in the file, skipping (never allocating) what it checks, so
//! the reader that follows only ever allocates for content that is really there.

use std::io::{Read, Seek, SeekFrom};

const MAGIC: u32 = 0x4655_4747; // "GGUF"
/// Deepest nesting of arrays accepted (GGUF writers produce 1).
const MAX_ARRAY_DEPTH: u32 = 2;
/// Most dimensions of a tensor (ggml's GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;
/// Most elements in one tensor (2^48: far beyond any model, far below overflow).
const MAX_ELEMS: u64 = 1 << 48;
/// Most elements of one metadata array, and of all of them together: a reader holds each as a
/// value of tens of bytes, whatever it takes in the file (real vocabularies and merge lists are
/// below a million).
const MAX_ARRAY: u64 = 1 << 22;
const MAX_ARRAY_TOTAL: u64 = 1 << 23;
/// Longest metadata string (chat templates are kilobytes).
const MAX_STRING: u64 = 16 << 20;

struct Walk<'a, R> {
    r: &'a mut R,
    pos: u64,
    len: u64,
    /// Width of lengths and counts: 4 bytes in GGUF v1, 8 after.
    wide: bool,
    /// Array elements seen so far.
    elements: u64,
}

/// Longest span [`Walk::skip`] reads through rather than seeks over.
const SEEK_FROM: u64 = 64 << 10;

impl<R: Read + Seek> Walk<'_, R> {
    fn left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn need(&self, n: u64, what: &str) -> Result<(), String> {
        if n > self.left() {
            return Err(format!(
                "{what} needs {n} bytes at offset {}, only {} are left in the file",
                self.pos,
                self.left()
            ));
        }
        Ok(())
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        self.need(N as u64, what)?;
        let mut b = [0u8; N];
        self.r
            .read_exact(&mut b)
            .map_err(|e| format!("{what}: {e}"))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.bytes(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.bytes(what)?))
    }

    fn count(&mut self, what: &str) -> Result<u64, String> {
        if self.wide {
            self.u64(what)
        } else {
            self.u32(what).map(u64::from)
        }
    }

    /// Skips `n` bytes: a short span is read through (a buffered reader serves it from its
    /// buffer; a seek would drop the buffer and cost two system calls a string, 98,000 for a
    /// 49,152-token vocabulary), a long one is seeked over.
    fn skip(&mut self, n: u64, what: &str) -> Result<(), String> {
        self.need(n, what)?;
        let skipped = if n <= SEEK_FROM {
            std::io::copy(&mut (&mut *self.r).take(n), &mut std::io::sink()).and_then(|got| {
                match got == n {
                    true => Ok(()),
                    false => Err(std::io::ErrorKind::UnexpectedEof.into()),
                }
            })
        } else {
            self.r.seek(SeekFrom::Current(n as i64)).map(drop)
        };
        skipped.map_err(|e| format!("{what}: {e}"))?;
        self.pos += n;
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<(), String> {
        let n = self.count(what)?;
        if n > MAX_STRING {
            return Err(format!(
                "{what}: a string of {n} bytes (at most {MAX_STRING})"
            ));
        }
        self.skip(n, what)
    }

    /// Bytes one value of a fixed-size type takes (None: string or array).
    fn fixed(ty: u32) -> Result<Option<u64>, String> {
        Ok(match ty {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            8 | 9 => None,
            t => return Err(format!("unknown metadata value type {t}")),
        })
    }

    fn value(&mut self, ty: u32, depth: u32, what: &str) -> Result<(), String> {
        match Self::fixed(ty)? {
            Some(n) => self.skip(n, what),
            None if ty == 8 => self.string(what),
            None => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!(
                        "{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    ));
                }
                let et = self.u32(what)?;
                let n = self.count(what)?;
                self.elements = self.elements.saturating_add(n);
                if n > MAX_ARRAY || self.elements > MAX_ARRAY_TOTAL {
                    return Err(format!(
                        "{what}: an array of {n} elements (at most {MAX_ARRAY}, {MAX_ARRAY_TOTAL} in all)"
                    ));
                }
                // Every element takes at least its fixed size, or a length field.
                let min = Self::fixed(et)?.unwrap_or(if self.wide { 8 } else { 4 });
                let total = n
                    .checked_mul(min)
                    .ok_or_else(|| format!("{what}: an array of {n} elements"))?;
                self.need(total, &format!("{what} (an array of {n} elements)"))?;
                match Self::fixed(et)? {
                    Some(_) => self.skip(total, what),
                    None => {
                        for _ in 0..n {
                            self.value(et, depth + 1, what)?;
                        }
                        Ok(())
                    }
                }
            }
        }
    }
}

/// Walks the header of the GGUF in `r` (`len` bytes long): every length and count must fit in
/// the file. Leaves `r` at an unspecified position. Returns the header's length (where the
/// tensor infos end, before the alignment padding). The error names the field at fault.
pub fn scan<R: Read + Seek>(r: &mut R, len: u64) -> Result<u64, String> {
    r.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
    let mut w = Walk {
        r,
        pos: 0,
        len,
        wide: true,
        elements: 0,
    };
    if w.u32("the magic number")? != MAGIC {
        return Err("no GGUF magic number".into());
    }
    let version = w.u32("the version")?;
    if !(1..=3).contains(&version) {
        return Err(format!("GGUF version {version} (1 to 3 are known)"));
    }
    w.wide = version >= 2;
    let tensors = w.count("the tensor count")?;
    let kvs = w.count("the metadata count")?;
    // Each metadata entry takes at least a key length, a type and one byte; each tensor info a
    // name length, a dimension count, one dimension, a type and an offset.
    let lw = if w.wide { 8 } else { 4 };
    w.need(
        kvs.saturating_mul(lw + 4 + 1),
        &format!("{kvs} metadata entries"),
    )?;
    w.need(
        tensors.saturating_mul(lw + 4 + lw + 4 + 8),
        &format!("{tensors} tensor infos"),
    )?;
    for i in 0..kvs {
        let what = format!("metadata entry {i}");
        w.string(&what)?;
        let ty = w.u32(&what)?;
        w.value(ty, 0, &what)?;
    }
    for i in 0..tensors {
        let what = format!("tensor info {i}");
        w.string(&what)?;
        let dims = w.u32(&what)?;
        if dims == 0 || dims > MAX_DIMS {
            return Err(format!("{what}: {dims} dimensions (1 to {MAX_DIMS})"));
        }
        let mut elems: u64 = 1;
        for _ in 0..dims {
            let d = w.count(&what)?;
            elems = elems
                .checked_mul(d)
                .filter(|&e| e <= MAX_ELEMS)
                .ok_or_else(|| format!("{what}: more than 2^48 elements"))?;
        }
        w.u32(&what)?; // type: checked by the reader
        w.u64(&what)?; // offset: checked against the file size after reading
    }
    Ok(w.pos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn header(tensors: u64, kvs: u64) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&tensors.to_le_bytes());
        b.extend_from_slice(&kvs.to_le_bytes());
        b
    }

    fn key(b: &mut Vec<u8>, k: &str) {
        b.extend_from_slice(&(k.len() as u64).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
    }

    fn run(b: &[u8]) -> Result<u64, String> {
        scan(&mut Cursor::new(b), b.len() as u64)
    }

    #[test]
    fn hostile_lengths_and_counts_are_refused_without_allocating() {
        // A 1 TiB string.
        let mut b = header(0, 1);
        key(&mut b, "general.name");
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let e = run(&b).unwrap_err();
        assert!(e.contains("1099511627776 bytes"), "{e}");
        // A 2^40-element array of u32.
        let mut b = header(0, 1);
        key(&mut b, "tokenizer.ggml.token_type");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let e = run(&b).unwrap_err();
        assert!(e.contains("an array of 1099511627776 elements"), "{e}");
        // An array length whose byte size overflows.
        let mut b = header(0, 1);
        key(&mut b, "x");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&10u32.to_le_bytes());
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(run(&b).is_err());
        // Counts far beyond the file.
        assert!(run(&header(1 << 40, 0))
            .unwrap_err()
            .contains("tensor infos"));
        assert!(run(&header(0, u64::MAX))
            .unwrap_err()
            .contains("metadata entries"));
        // A tensor whose element count overflows.
        let mut b = header(1, 0);
        key(&mut b, "t");
        b.extend_from_slice(&4u32.to_le_bytes());
        for _ in 0..4 {
            b.extend_from_slice(&(1u64 << 20).to_le_bytes());
        }
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        assert!(run(&b).unwrap_err().contains("2^48"));
        // Not GGUF at all.
        assert!(run(b"hello").is_err());
        // An array whose bytes are really in the file, but whose elements a reader would hold
        // at tens of bytes each.
        let mut b = header(0, 1);
        key(&mut b, "x");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&(MAX_ARRAY + 1).to_le_bytes());
        b.resize(b.len() + MAX_ARRAY as usize + 1, 0);
        assert!(run(&b).unwrap_err().contains("at most"));
    }

    #[test]
    fn a_well_formed_header_passes() {
        let mut b = header(1, 2);
        key(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        key(&mut b, "llama");
        key(&mut b, "tokens");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        key(&mut b, "a");
        key(&mut b, "bc");
        key(&mut b, "w");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&8u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        assert_eq!(run(&b), Ok(b.len() as u64), "the whole buffer is header");
    }
}
