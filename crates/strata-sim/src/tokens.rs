//! Deterministic token ids for trace blocks: equal hash ids give equal tokens, so two requests
//! sharing k ids share their first k blocks of tokens.

/// SplitMix64 step (the workspace's one generator, `strata_kv::rng`).
pub use strata_kv::rng::{mix, SplitMix64};

/// Appends the first `n` tokens of block `id` (a block has `block_tokens` tokens).
/// `vocab == 0` is the identity mapping for one-token blocks: the token is the id itself
/// (the way peers replay traces at block granularity); ids must then fit in 32 bits.
pub fn block_tokens(id: u64, n: usize, vocab: u32, out: &mut Vec<u32>) {
    if vocab == 0 {
        assert!(
            n <= 1 && id <= u32::MAX as u64,
            "identity tokens need one-token blocks and 32-bit ids"
        );
        out.extend(std::iter::repeat_n(id as u32, n));
        return;
    }
    let seed = mix(id ^ 0x5354_5241_5441_0001);
    out.extend((0..n as u64).map(|i| (mix(seed.wrapping_add(i)) % vocab as u64) as u32));
}

/// The prompt of a request: its blocks' tokens, the last block cut to `input_length`.
pub fn request_tokens(hash_ids: &[u64], input_length: usize, block: usize, vocab: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(input_length);
    for (i, &id) in hash_ids.iter().enumerate() {
        let n = block.min(input_length - i * block);
        block_tokens(id, n, vocab, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_ids_share_tokens_and_partial_blocks_are_prefixes() {
        let a = request_tokens(&[1, 2, 3], 1100, 512, 49152);
        let b = request_tokens(&[1, 2], 1024, 512, 49152);
        assert_eq!(a.len(), 1100);
        assert_eq!(&a[..1024], &b[..]);
        let c = request_tokens(&[1, 9], 600, 512, 49152);
        assert_eq!(&a[..512], &c[..512]);
        assert_ne!(&a[512..600], &c[512..]);
        let full = request_tokens(&[7], 512, 512, 49152);
        let part = request_tokens(&[7], 100, 512, 49152);
        assert_eq!(&full[..100], &part[..]);
        assert!(a.iter().all(|&t| t < 49152));
        // Fixed values: the mapping is part of how reported figures are reproduced.
        assert_eq!(
            &request_tokens(&[0], 3, 512, 49152)[..],
            &[1815, 17859, 46889]
        );
    }
}
