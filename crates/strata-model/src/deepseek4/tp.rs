//! DeepSeek-V4 over tensor-parallel ranks inside one server ([`Dsv4Tp`]): each rank a
//! [`Dsv4`] holding its [`Dsv4Part`] on its own pinned threads (`crate::llama::tp_ranks`), its copy
//! of every state kind in its own pool kinds (`raw.tpR`, `csa.tpR`, ...: the state is one
//! K = V head, replicated, as the plan sizes it), one radix tree and page allocator for all.
//!
//! A call runs the ranks in lock-step, layer by layer: for every position of the call, each
//! rank computes its share of each layer's attention for all the call's sequences (in
//! parallel on its workers), the ranks sum their shares (one all-reduce per layer and half
//! layer for the whole batch), then the feed-forward likewise; the logits' vocabulary rows
//! are gathered at the end. Every rank sums in rank order, so every rank holds the same
//! streams and writes the same state bits; they differ from one rank's by rounding only.
//!
//! Pages cross to other workers (PD) in the whole model's layout: one copy of each kind
//! (rank 0's), and a copy for every rank on the way in.

use std::path::Path;

use rayon::prelude::*;
use strata_kv::pool::DevicePool;
use strata_kv::PoolKind;

use crate::deepseek4::paged::{PageMap, Paged};
use crate::deepseek4::{Dsv4, Dsv4Config, Dsv4Part};
use crate::error::ModelError;
use crate::llama::tp_ranks::{RankPlacement, RankSet};
use crate::llama::SeqInput;
use crate::shard::Collective;

/// DeepSeek-V4 split over tensor-parallel ranks (see the module notes).
pub struct Dsv4Tp {
    models: Vec<Dsv4>,
    ranks: RankSet,
}

impl Dsv4Tp {
    /// Loads each rank's part on the rank's own (pinned) threads.
    pub fn load(
        path: &Path,
        placements: &[RankPlacement],
        threads_per_rank: usize,
    ) -> Result<Dsv4Tp, ModelError> {
        let cfg = crate::deepseek4::load::read_dsv4_config(path)?;
        let parts = Dsv4Part::split(&cfg, placements.len())?;
        let ranks = RankSet::new(placements, threads_per_rank)?;
        let models =
            ranks.load(&|r| crate::deepseek4::load::load_dsv4_part(path, parts[r].clone()))?;
        Ok(Dsv4Tp { models, ranks })
    }

    pub fn config(&self) -> &Dsv4Config {
        &self.models[0].cfg
    }

    /// Ranks.
    pub fn tp(&self) -> usize {
        self.models.len()
    }

    /// Bytes of a page's main part and window part in the whole model's layout.
    fn wire_parts(&self, ps: usize) -> Result<(usize, usize), ModelError> {
        let (mut main, mut window) = (0, 0);
        for k in self.models[0].pool_kinds(ps)? {
            let b = ps * k.bytes_per_token();
            match k.window {
                None => main += b,
                Some(_) => window += b,
            }
        }
        Ok((main, window))
    }

    /// A page blob (main part, then its window part if any) from one layout to the other:
    /// `tp` copies of each part side by side locally, one on the wire.
    fn reshard(&self, ps: usize, blob: &[u8], to_wire: bool) -> Result<Vec<u8>, ModelError> {
        let (m, w) = self.wire_parts(ps)?;
        let tp = self.tp();
        let (from, each) = if to_wire { (tp, 1) } else { (1, tp) };
        let with_window = if blob.len() == from * m {
            false
        } else if w > 0 && blob.len() == from * (m + w) {
            true
        } else {
            return Err(ModelError::Forward(format!(
                "a state page of {} bytes: expected {} (main part) or {} (with its window part)",
                blob.len(),
                from * m,
                from * (m + w)
            )));
        };
        let mut out = Vec::with_capacity(each * (m + if with_window { w } else { 0 }));
        for _ in 0..each {
            out.extend_from_slice(&blob[..m]);
        }
        if with_window {
            let win = from * m;
            for _ in 0..each {
                out.extend_from_slice(&blob[win..win + w]);
            }
        }
        Ok(out)
    }
}

impl Dsv4 {
    /// This rank's pass over the call in lock-step with the other ranks (module notes):
    /// per sequence, the logits of its last token or (`all[i]`) of every token, on rank 0.
    pub(crate) fn forward_part(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
        map: &PageMap,
        comm: &dyn Collective,
    ) -> Result<Option<Vec<Vec<f32>>>, ModelError> {
        let e = self.cfg.embd * self.cfg.hc;
        let steps = seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
        let mut rows: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
        let mut counts = vec![0usize; seqs.len()];
        let mut hs: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
        for j in 0..steps {
            let live: Vec<usize> = (0..seqs.len())
                .filter(|&i| seqs[i].tokens.len() > j)
                .collect();
            for &i in &live {
                hs[i] = self.embed(seqs[i].tokens[j]);
            }
            for l in 0..self.cfg.ratios.len() {
                // Attention: every live sequence's share, summed over the ranks at once.
                let halves: Vec<_> = live
                    .par_iter()
                    .map(|&i| {
                        let s = &seqs[i];
                        let mut st = Paged::of(pool, s, map);
                        self.attn_half(&hs[i], s.pos + j, l, &mut st)
                    })
                    .collect();
                self.sum_and_post(&live, &mut hs, halves, comm);
                let halves: Vec<_> = live
                    .par_iter()
                    .map(|&i| self.ffn_half(&hs[i], seqs[i].tokens[j], l))
                    .collect();
                self.sum_and_post(&live, &mut hs, halves, comm);
            }
            for &i in &live {
                if all[i] || j + 1 == seqs[i].tokens.len() {
                    debug_assert_eq!(hs[i].len(), e);
                    rows[i].extend(self.head(&hs[i]));
                    counts[i] += 1;
                }
            }
        }
        // Every rank's vocabulary rows of every logits row, gathered on rank 0.
        let n: usize = counts.iter().sum();
        let flat: Vec<f32> = rows.into_iter().flatten().collect();
        let Some(whole) = comm.gather_vocab(flat, n) else {
            return Ok(None);
        };
        let v = self.cfg.vocab;
        let mut at = 0;
        Ok(Some(
            counts
                .iter()
                .map(|&c| {
                    at += c * v;
                    whole[at - c * v..at].to_vec()
                })
                .collect(),
        ))
    }

    /// Sums the live sequences' shares over the ranks (one all-reduce) and applies each
    /// sequence's hyper-connection post step.
    fn sum_and_post(
        &self,
        live: &[usize],
        hs: &mut [Vec<f32>],
        halves: Vec<crate::deepseek4::Half>,
        comm: &dyn Collective,
    ) {
        let e = self.cfg.embd;
        let mut sum: Vec<f32> = halves.iter().flat_map(|h| h.0.iter().copied()).collect();
        comm.all_reduce(&mut sum);
        let next: Vec<Vec<f32>> = live
            .par_iter()
            .zip(&halves)
            .enumerate()
            .map(|(k, (&i, (_, post, comb)))| {
                self.hc_post(&sum[k * e..(k + 1) * e], &hs[i], post, comb)
            })
            .collect();
        for (&i, h) in live.iter().zip(next) {
            hs[i] = h;
        }
    }
}

impl crate::Runtime for Dsv4Tp {
    fn architecture(&self) -> &'static str {
        "deepseek4"
    }
    /// As one rank's ([`crate::Runtime`] for `Dsv4`).
    fn decode_rows_differ(&self) -> bool {
        false
    }
    fn context_length(&self) -> usize {
        self.config().context
    }
    fn vocab(&self) -> usize {
        self.config().vocab
    }
    fn pool_kinds(&self, page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        let mut out = Vec::new();
        for (r, m) in self.models.iter().enumerate() {
            out.extend(m.rank_kinds(page_size, r, self.tp())?);
        }
        Ok(out)
    }
    fn wire_kinds(&self, page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        self.models[0].pool_kinds(page_size)
    }
    fn page_to_wire(&self, ps: usize, blob: &[u8]) -> Result<Option<Vec<u8>>, ModelError> {
        if self.tp() == 1 {
            return Ok(None);
        }
        self.reshard(ps, blob, true).map(Some)
    }
    fn page_from_wire(&self, ps: usize, blob: &[u8]) -> Result<Option<Vec<u8>>, ModelError> {
        if self.tp() == 1 {
            return Ok(None);
        }
        self.reshard(ps, blob, false).map(Some)
    }
    fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        assert_eq!(all.len(), seqs.len(), "one logits choice per sequence");
        // Every check a rank makes, made before any rank waits on another.
        let tp = self.tp();
        let maps = self
            .models
            .iter()
            .enumerate()
            .map(|(r, m)| m.page_map(pool, Some((r, tp))))
            .collect::<Result<Vec<_>, _>>()?;
        self.models[0].check_seqs(pool, seqs)?;
        self.ranks
            .run(&|r, c| self.models[r].forward_part(pool, seqs, all, &maps[r], c))
    }
}
