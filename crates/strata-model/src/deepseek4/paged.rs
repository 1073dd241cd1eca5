//! DeepSeek-V4 over the tiered cache's device pages: the pool kinds its state needs
//! (docs/ARCHITECTURE.md, "DeepSeek-V4 state in the tiered cache") and the forward pass the
//! engine runs, the reference arithmetic (`crate::deepseek4`) with every state item in a sequence's
//! pages ([`Paged`]). A page of `ps` tokens holds, for each kind, what its tokens produce:
//!
//! | kind | layers | planes | per page |
//! |---|---|---|---|
//! | `raw` | every layer | K (= V) | `ps` rows of D f32 |
//! | `csa` | ratio-4 | compressed K | `ps / 4` blocks of D f32 (block b in the page of token 4b) |
//! | `index` | ratio-4 | indexer key | `ps / 4` blocks of Di f32 |
//! | `hca` | ratio-128 | compressed K | `max(1, ps / 128)` blocks of D f32 (in the page of the block's last token) |
//! | `csa_rows` | ratio-4 | value, score | `ps` rows of 2D f32 each |
//! | `index_rows` | ratio-4 | value, score | `ps` rows of 2Di f32 each |
//! | `hca_rows` | ratio-128 | value, score | `ps` rows of D f32 each |
//!
//! So a prefix ending at any page boundary carries everything a continuation reads, and pages
//! move between tiers, to disk, Redis and a decode worker as today's K/V pages do. Sequences of
//! a call run in parallel; each runs its tokens in order through the reference arithmetic, so a
//! token's logits are the same bits whatever the batch, the chunking or where its prefix's
//! pages came from.

use rayon::prelude::*;
use strata_kv::pool::DevicePool;
use strata_kv::PoolKind;

use crate::deepseek4::store::{Rows, Store};
use crate::deepseek4::Dsv4;
use crate::error::ModelError;
use crate::llama::SeqInput;
use crate::shard::Solo;

/// Where each state item of a model lives in a page layout.
pub(crate) struct PageMap {
    ps: usize,
    d: usize,
    di: usize,
    /// Per layer: its ordinal among the layers of its ratio (the layer index in its kinds).
    ord: Vec<usize>,
    ratios: Vec<usize>,
    raw: usize,
    csa: usize,
    index: usize,
    hca: usize,
    csa_rows: usize,
    index_rows: usize,
    hca_rows: usize,
}

fn kind_err(msg: String) -> ModelError {
    ModelError::Forward(msg)
}

impl Dsv4 {
    /// The pool kinds this model's state takes in pages of `page_size` tokens (one rank; the
    /// state is one K = V head, the same on every tensor-parallel rank). Kinds of a ratio no
    /// layer has are left out.
    pub fn pool_kinds(&self, page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        let c = &self.cfg;
        let ps = page_size;
        let bad = |why: &str| {
            kind_err(format!(
                "--page-size {ps} does not fit DeepSeek-V4's state: {why}"
            ))
        };
        let n4 = c.ratios.iter().filter(|&&r| r == 4).count();
        let n128 = c.ratios.iter().filter(|&&r| r == 128).count();
        if ps == 0 || (n4 > 0 && !ps.is_multiple_of(4)) {
            return Err(bad(
                "a page must hold whole 4-token blocks (a multiple of 4)",
            ));
        }
        let (d, di) = (c.head_dim * 4, c.indexer_dim * 4);
        // Only a model with ratio-128 layers needs its pages to fit 128-blocks.
        let slots =
            match hca_slots(ps) {
                Some(s) => s,
                None if n128 == 0 => 1,
                None => return Err(bad(
                    "a page must divide a 128-token block, or hold whole ones (e.g. 16, 64, 256)",
                )),
            };
        if n128 > 0 && !(slots * d).is_multiple_of(ps) {
            return Err(bad(
                "a compressed 128-block must split evenly over the page's tokens",
            ));
        }
        let one = |name: &str, layers, planes, bytes, window| PoolKind {
            name: name.into(),
            layers,
            planes,
            plane_bytes_per_token: bytes,
            window,
            dtype: None,
        };
        // Window kinds and what a continuation at P reads of them (docs/DSV4-FORWARD.md §11):
        // the raw K of [P + 1 − window, P]; a 4-block's rows from 4 tokens before it (7 before
        // P at most); an open 128-block's rows (127 before P at most).
        let kinds = [
            one("raw", c.ratios.len(), 1, d, Some(c.window)),
            one("csa", n4, 1, d / 4, None),
            one("index", n4, 1, di / 4, None),
            one("hca", n128, 1, slots * d / ps, None),
            one("csa_rows", n4, 2, 2 * d, Some(8)),
            one("index_rows", n4, 2, 2 * di, Some(8)),
            one("hca_rows", n128, 2, d, Some(128)),
        ];
        Ok(kinds.into_iter().filter(|k| k.layers > 0).collect())
    }

    /// This model's pool kinds renamed as tensor-parallel rank `rank`'s of `tp` (`raw.tp1`,
    /// ...; one rank keeps the plain names).
    pub(crate) fn rank_kinds(
        &self,
        page_size: usize,
        rank: usize,
        tp: usize,
    ) -> Result<Vec<PoolKind>, ModelError> {
        let mut kinds = self.pool_kinds(page_size)?;
        if tp > 1 {
            for k in &mut kinds {
                k.name = strata_kv::tp::rank_kind_name(&k.name, rank);
            }
        }
        Ok(kinds)
    }

    /// Where the state lives in `pool`: the whole layout is this model's kinds, or (`rank`
    /// of `tp` ranks) the layout is every rank's kinds in rank order and the rank's are its
    /// `rank`-th run of them.
    pub(crate) fn page_map(
        &self,
        pool: &DevicePool,
        rank: Option<(usize, usize)>,
    ) -> Result<PageMap, ModelError> {
        let c = &self.cfg;
        let ps = pool.layout().page_size();
        let (want, first, tp) = match rank {
            None => (self.pool_kinds(ps)?, 0, 1),
            Some((r, tp)) => {
                let k = self.rank_kinds(ps, r, tp)?;
                let n = k.len();
                (k, r * n, tp)
            }
        };
        let kinds = pool.layout().kinds();
        if kinds.len() != want.len() * tp || kinds[first..first + want.len()] != want[..] {
            return Err(kind_err(format!(
                "device pool layout {kinds:?} does not match the model's {want:?}{}",
                match rank {
                    Some((r, tp)) => format!(" (rank {r} of {tp})"),
                    None => String::new(),
                }
            )));
        }
        let at = |name: &str| {
            want.iter()
                .position(|k| k.name.split(".tp").next() == Some(name))
                .map_or(usize::MAX, |i| first + i)
        };
        let mut seen = [0usize; 3];
        let ord = c
            .ratios
            .iter()
            .map(|&r| {
                let g = match r {
                    0 => 0,
                    4 => 1,
                    _ => 2,
                };
                seen[g] += 1;
                seen[g] - 1
            })
            .collect();
        Ok(PageMap {
            ps,
            d: c.head_dim,
            di: c.indexer_dim,
            ord,
            ratios: c.ratios.clone(),
            raw: at("raw"),
            csa: at("csa"),
            index: at("index"),
            hca: at("hca"),
            csa_rows: at("csa_rows"),
            index_rows: at("index_rows"),
            hca_rows: at("hca_rows"),
        })
    }

    /// Runs the model over the sequences' pages: writes every new token's state into its
    /// sequence's pages and returns, per sequence, the logits of its last token (`all[i]`: of
    /// every token, row after row).
    pub fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        assert_eq!(all.len(), seqs.len(), "one logits choice per sequence");
        if !self.part.is_whole(&self.cfg) {
            return Err(kind_err(
                "a rank's part runs with the other ranks (Dsv4Tp), not alone".into(),
            ));
        }
        let map = self.page_map(pool, None)?;
        self.check_seqs(pool, seqs)?;
        Ok(seqs
            .par_iter()
            .zip(all)
            .map(|(s, &all)| {
                let mut st = Paged::of(pool, s, &map);
                let mut out = Vec::new();
                for (j, &t) in s.tokens.iter().enumerate() {
                    let hs = self.token(&mut st, s.pos + j, t, &Solo);
                    if all || j + 1 == s.tokens.len() {
                        out.extend(self.head(&hs));
                    }
                }
                out
            })
            .collect())
    }
}

impl Dsv4 {
    /// Every check a call's sequences must pass before any state is written (and before any
    /// tensor-parallel rank waits on another): sizes, tokens, positions, and pages.
    pub(crate) fn check_seqs(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
    ) -> Result<(), ModelError> {
        for (si, s) in seqs.iter().enumerate() {
            crate::llama::check_seq(pool, si, s, self.cfg.context, self.cfg.vocab)?;
        }
        // Sequences run in parallel: the pages they write must be distinct (a request's own
        // pages are; shared prefix pages are only read). Window pages are tagged apart.
        let ps = pool.layout().page_size();
        let mut written: Vec<(u64, usize)> = seqs
            .iter()
            .enumerate()
            .flat_map(|(si, s)| {
                let r = s.written(ps);
                let main = s.pages[r.clone()].iter().map(|&p| p as u64);
                let win = s.windows[r].iter().map(|&w| (1 << 32) | w as u64);
                main.chain(win).map(move |p| (p, si))
            })
            .collect();
        written.sort_unstable();
        if let Some(w) = written
            .windows(2)
            .find(|w| w[0].0 == w[1].0 && w[0].1 != w[1].1)
        {
            let what = if w[0].0 >> 32 == 1 {
                "window page"
            } else {
                "page"
            };
            return Err(kind_err(format!(
                "sequences {} and {} both write {what} {}",
                w[0].1, w[1].1, w[0].0 as u32
            )));
        }
        Ok(())
    }
}

/// Compressed 128-blocks per page: one (in the page of its last token) when a page divides a
/// block, `ps / 128` when a page holds whole blocks; `None` otherwise.
fn hca_slots(ps: usize) -> Option<usize> {
    if ps <= 128 && 128 % ps == 0 {
        Some(1)
    } else if ps.is_multiple_of(128) {
        Some(ps / 128)
    } else {
        None
    }
}

/// One sequence's state in its device pages.
pub(crate) struct Paged<'a> {
    pool: &'a DevicePool,
    pages: &'a [u32],
    /// The window page of each page (window kinds live there).
    windows: &'a [u32],
    map: &'a PageMap,
}

impl<'a> Paged<'a> {
    pub(crate) fn of(pool: &'a DevicePool, s: &SeqInput<'a>, map: &'a PageMap) -> Paged<'a> {
        Paged {
            pool,
            pages: s.pages,
            windows: s.windows,
            map,
        }
    }
}

/// Where an item lives: kind, layer of the kind, page, and its index in units of its width.
type Place = (usize, usize, u32, usize);

impl Paged<'_> {
    fn read(&self, (kind, layer, page, slot): Place, plane: usize, width: usize) -> &[f32] {
        let v = as_f32(self.pool.plane(kind, layer, plane));
        let per_page =
            self.pool.layout().kinds()[kind].plane_bytes_per_token * self.map.ps / (4 * width);
        let at = (page as usize * per_page + slot) * width;
        &v[at..at + width]
    }

    fn write(&self, (kind, layer, page, slot): Place, plane: usize, data: &[f32]) {
        let off = slot * data.len() * 4;
        self.pool
            .write_at(kind, layer, plane, page, off, f32_bytes(data));
    }

    /// A per-token item of position `p` (every per-token kind is a window kind: it lives in
    /// the window page of `p`'s page).
    fn token_place(&self, kind: usize, layer: usize, p: usize) -> Place {
        let ps = self.map.ps;
        (kind, layer, self.windows[p / ps], p % ps)
    }

    /// A compressed block `b` of layer `l` (its kind, ratio 4 or 128).
    fn block_place(&self, kind: usize, l: usize, b: usize) -> Place {
        let (m, ps) = (self.map, self.map.ps);
        let layer = m.ord[l];
        if m.ratios[l] == 4 {
            (kind, layer, self.pages[4 * b / ps], (4 * b % ps) / 4)
        } else {
            let page = self.pages[(128 * b + 127) / ps];
            let slot = if ps > 128 { b % (ps / 128) } else { 0 };
            (kind, layer, page, slot)
        }
    }

    fn rows_kind(&self, l: usize, which: Rows) -> (usize, usize) {
        let m = self.map;
        match (m.ratios[l], which) {
            (4, Rows::Attn) => (m.csa_rows, 2 * m.d),
            (4, Rows::Index) => (m.index_rows, 2 * m.di),
            _ => (m.hca_rows, m.d),
        }
    }

    fn block_kind(&self, l: usize) -> usize {
        if self.map.ratios[l] == 4 {
            self.map.csa
        } else {
            self.map.hca
        }
    }
}

impl Store for Paged<'_> {
    fn put_raw(&mut self, l: usize, p: usize, k: &[f32]) {
        self.write(self.token_place(self.map.raw, l, p), 0, k);
    }
    fn raw(&self, l: usize, p: usize) -> &[f32] {
        self.read(self.token_place(self.map.raw, l, p), 0, self.map.d)
    }
    fn put_row(&mut self, l: usize, which: Rows, p: usize, kv: &[f32], sc: &[f32]) {
        let (kind, _) = self.rows_kind(l, which);
        let at = self.token_place(kind, self.map.ord[l], p);
        self.write(at, 0, kv);
        self.write(at, 1, sc);
    }
    fn row(&self, l: usize, which: Rows, p: usize) -> (&[f32], &[f32]) {
        let (kind, w) = self.rows_kind(l, which);
        let at = self.token_place(kind, self.map.ord[l], p);
        (self.read(at, 0, w), self.read(at, 1, w))
    }
    fn put_block(&mut self, l: usize, b: usize, k: &[f32]) {
        self.write(self.block_place(self.block_kind(l), l, b), 0, k);
    }
    fn block(&self, l: usize, b: usize) -> &[f32] {
        self.read(self.block_place(self.block_kind(l), l, b), 0, self.map.d)
    }
    fn put_index_key(&mut self, l: usize, b: usize, k: &[f32]) {
        self.write(self.block_place(self.map.index, l, b), 0, k);
    }
    fn index_key(&self, l: usize, b: usize) -> &[f32] {
        self.read(self.block_place(self.map.index, l, b), 0, self.map.di)
    }
}

fn as_f32(b: &[u8]) -> &[f32] {
    // SAFETY: every bit pattern is a valid f32, and align_to only reinterprets the aligned
    // middle. Pool regions are 4 KiB aligned and every chunk of these kinds is a multiple of 4
    // bytes, so planes start 4-byte aligned and have no ragged ends (asserted below).
    let (pre, mid, post) = unsafe { b.align_to::<f32>() };
    assert!(
        pre.is_empty() && post.is_empty(),
        "pool plane is not f32-aligned"
    );
    mid
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: a u8 view of initialised f32s covers exactly their bytes (alignment 1).
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
