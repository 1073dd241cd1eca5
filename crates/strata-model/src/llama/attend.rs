//! A llama layer's attention over the pages ([`crate::attn`]): each sequence's K/V gathered
//! once per layer into f32, rows in tiles of one sequence, rows split across threads by work.
//! Sequences go in groups whose gathered copies stay within [`GATHER_BYTES`] (a sequence
//! larger than that alone), so a call over many long prefixes, shared or not, never holds a
//! copy of each at once; the memory plan counts that bound (`crate::scratch`). A row's bits do
//! not depend on its group, as they do not on the threads.

use std::ops::Range;

use strata_kv::pool::DevicePool;

use super::Model;
use crate::attn;
use crate::seq::SeqInput;

/// The most bytes of gathered K/V one group of sequences holds (one sequence alone may hold
/// more: its whole context).
pub(crate) const GATHER_BYTES: usize = 64 << 20;

impl Model {
    /// Causal attention of every row over its sequence's pages.
    pub(super) fn attention(
        &self,
        pool: &DevicePool,
        layer: usize,
        seqs: &[SeqInput],
        rows: &[(usize, usize)],
        q: &[f32],
    ) -> Vec<f32> {
        let c = &self.config;
        let shape = attn::Shape {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        };
        // A row of queries (and of outputs): every head.
        let h = c.heads * c.head_dim;
        let ps = pool.layout().page_size();
        let planes = (self.plane(pool, layer, 0), self.plane(pool, layer, 1));
        let mut out = vec![0f32; rows.len() * h];
        let ctx = contexts(seqs, rows);
        let mut first = 0;
        for group in groups(shape, seqs, &ctx, self.gather_budget) {
            let gathered = gather(shape, planes, ps, seqs, &ctx, group.clone());
            // The group's rows: those of its sequences (rows come sequence by sequence).
            let n = rows[first..].iter().take_while(|r| r.0 < group.end).count();
            let span = first..first + n;
            let o = &mut out[span.start * h..span.end * h];
            self.attend_rows(shape, planes, ps, (seqs, rows, q), &gathered, span, o);
            first += n;
        }
        out
    }

    /// Attention of the rows `span` (their outputs in `out`), their sequences' K/V in
    /// `gathered` where they have tiles.
    #[allow(clippy::too_many_arguments)]
    fn attend_rows(
        &self,
        shape: attn::Shape,
        (kp, vp): (attn::Plane, attn::Plane),
        ps: usize,
        (seqs, rows, q): (&[SeqInput], &[(usize, usize)], &[f32]),
        gathered: &[Option<attn::SeqKv>],
        span: Range<usize>,
        out: &mut [f32],
    ) {
        let h = shape.heads * shape.head_dim;
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        // Splitting only pays on enough work (a single decode row is done inline), and over
        // no more threads than there are pieces: whole tiles of the rows of gathered
        // sequences, and single rows of the others.
        let work: usize = rows[span.clone()].iter().map(|r| r.1 + 1).sum();
        let tiled = rows[span.clone()]
            .iter()
            .filter(|r| gathered[r.0].is_some())
            .count();
        let pieces = tiled.div_ceil(attn::TILE_ROWS) + (span.len() - tiled);
        let threads = match work < 1024 {
            true => 1,
            false => self.threads.min(pieces),
        };
        let run = |first: usize, chunk: &mut [f32]| {
            let n_rows = chunk.len() / h;
            let mut pos = Vec::with_capacity(attn::TILE_ROWS);
            let mut r0 = 0;
            while r0 < n_rows {
                let si = rows[first + r0].0;
                let s = &seqs[si];
                // A decode step's row reads the pages alone; every prompt row (its last token
                // too, alone after a full prefix hit) takes the tile, so a position's K/V are
                // the same bits whether or not it ended an earlier prompt.
                let last = s.pos + s.tokens.len() - 1;
                let alone = |r: usize| rows[first + r].1 == last && gathered[si].is_none();
                let mut r1 = r0 + 1;
                while r1 < n_rows
                    && r1 - r0 < attn::TILE_ROWS
                    && rows[first + r1].0 == si
                    && !alone(r0)
                    && !alone(r1)
                {
                    r1 += 1;
                }
                pos.clear();
                pos.extend((r0..r1).map(|r| rows[first + r].1));
                let qs = &q[(first + r0) * h..(first + r1) * h];
                let o = &mut chunk[r0 * h..r1 * h];
                match &gathered[si] {
                    Some(kv) if !alone(r0) => attn::tile(shape, kv, qs, &pos, o, scale),
                    _ => attn::row(shape, kp, vp, s.pages, ps, qs, pos[0], o, scale),
                }
                r0 = r1;
            }
        };
        if threads == 1 {
            run(span.start, out);
            return;
        }
        // On the pool the pass runs on (no thread started per call).
        let bounds = split_by_work(&rows[span.clone()], threads, work);
        let run = &run;
        rayon::scope(|sc| {
            let mut rest: &mut [f32] = out;
            for w in bounds.windows(2) {
                let (chunk, tail) = rest.split_at_mut((w[1] - w[0]) * h);
                rest = tail;
                let first = span.start + w[0];
                sc.spawn(move |_| run(first, chunk));
            }
        });
    }
}

/// Each sequence's last position this call attends to, plus one.
fn contexts(seqs: &[SeqInput], rows: &[(usize, usize)]) -> Vec<usize> {
    let mut ctx = vec![0usize; seqs.len()];
    for &(si, p) in rows {
        ctx[si] = ctx[si].max(p + 1);
    }
    ctx
}

/// Whether a sequence has rows for the tile: every row but a decode step's single row, which
/// reads the pages directly. Prompt rows always do, however few: a row's bits, and so the K/V
/// later layers store for its position, are the tile's whether it is a prompt's last token,
/// alone after a full prefix hit, or inside a longer prompt that extends it.
fn tiled(s: &SeqInput) -> bool {
    !(s.decode && s.tokens.len() == 1)
}

/// Bytes of a sequence's gathered K/V over `n` positions.
fn gathered_bytes(shape: attn::Shape, n: usize) -> usize {
    n.div_ceil(attn::KB)
        * attn::KB
        * shape.kv_heads
        * shape.head_dim
        * 2
        * std::mem::size_of::<f32>()
}

/// Consecutive sequences in groups whose gathered K/V stay within `budget` bytes.
fn groups(
    shape: attn::Shape,
    seqs: &[SeqInput],
    ctx: &[usize],
    budget: usize,
) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut held) = (0, 0);
    for (i, s) in seqs.iter().enumerate() {
        let b = if tiled(s) {
            gathered_bytes(shape, ctx[i])
        } else {
            0
        };
        if i > start && held + b > budget {
            out.push(start..i);
            (start, held) = (i, 0);
        }
        held += b;
    }
    out.push(start..seqs.len());
    out
}

/// The K/V of the sequences of `group` that have tiles, up to the last position this call
/// attends to (None for the others).
fn gather(
    shape: attn::Shape,
    (kp, vp): (attn::Plane, attn::Plane),
    ps: usize,
    seqs: &[SeqInput],
    ctx: &[usize],
    group: Range<usize>,
) -> Vec<Option<attn::SeqKv>> {
    (0..seqs.len())
        .map(|i| {
            let s = &seqs[i];
            (group.contains(&i) && tiled(s))
                .then(|| attn::SeqKv::gather(shape, kp, vp, s.pages, ps, ctx[i]))
        })
        .collect()
}

/// Splits rows so each of `threads` gets the same attention work (a row's work grows with
/// its position, so equal row counts would leave the last thread the most); returns the
/// boundaries, first 0 and last `rows.len()`.
fn split_by_work(rows: &[(usize, usize)], threads: usize, work: usize) -> Vec<usize> {
    let mut bounds = vec![0];
    let mut acc = 0;
    for (i, r) in rows.iter().enumerate() {
        acc += r.1 + 1;
        if acc * threads >= work * bounds.len() && bounds.len() < threads {
            bounds.push(i + 1);
        }
    }
    bounds.push(rows.len());
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_go_in_groups_within_the_budget_a_large_one_alone() {
        let shape = attn::Shape {
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
        };
        // K and V of 2 × 64 f32 values a position: 1 KiB, so the budget is 65,536 positions.
        assert_eq!(
            gathered_bytes(shape, 1),
            32 << 10,
            "whole 32-position blocks"
        );
        let budget = GATHER_BYTES / (1 << 10);
        let (one, two): (&[u32], &[u32]) = (&[1], &[1, 2]);
        let seq = |tokens, decode| SeqInput {
            tokens,
            pos: 0,
            pages: &[],
            windows: &[],
            decode,
        };
        // Two prefills that fit together; a third over the budget with them, and a decode row
        // (nothing gathered) with it; one larger than the budget, alone.
        let seqs = [
            seq(two, false),
            seq(two, false),
            seq(two, false),
            seq(one, true),
            seq(two, false),
        ];
        let ctx = [budget / 4, budget / 2, budget / 2, budget, 2 * budget];
        let g = |n: usize| groups(shape, &seqs[..n], &ctx[..n], GATHER_BYTES);
        assert_eq!(g(5), vec![0..2, 2..4, 4..5]);
        assert_eq!(g(2), vec![0..2]);
        // A budget of nothing: every sequence alone.
        assert_eq!(
            groups(shape, &seqs, &ctx, 0),
            vec![0..1, 1..2, 2..3, 3..4, 4..5]
        );
    }
}
