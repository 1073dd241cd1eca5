//! Where DeepSeek-V4's per-sequence state lives between tokens (docs/DSV4-FORWARD.md §11): the
//! forward pass (`crate::deepseek4`) reads and writes it only through [`Store`], so the reference
//! (every item held whole, [`Dsv4State`]) and the paged pass over the tiered cache's device
//! pool (`crate::deepseek4::paged`) run the same arithmetic and give the same bits.

/// Which compressor's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rows {
    /// The attention compressor (ratio-4 and ratio-128 layers).
    Attn,
    /// The indexer's compressor (ratio-4 layers).
    Index,
}

/// One sequence's state, by layer `l` (of the model) and position `p` or block `b`. Items are
/// written once, in position order, before they are read.
pub(crate) trait Store {
    /// Raw K (= V) of position `p` after the kv norm and RoPE (every layer).
    fn put_raw(&mut self, l: usize, p: usize, k: &[f32]);
    fn raw(&self, l: usize, p: usize) -> &[f32];
    /// A compressor's row of position `p`: value and score (with the position embedding).
    fn put_row(&mut self, l: usize, which: Rows, p: usize, kv: &[f32], sc: &[f32]);
    fn row(&self, l: usize, which: Rows, p: usize) -> (&[f32], &[f32]);
    /// Compressed block `b` of a ratio-4 (CSA) or ratio-128 (HCA) layer.
    fn put_block(&mut self, l: usize, b: usize, k: &[f32]);
    fn block(&self, l: usize, b: usize) -> &[f32];
    /// The indexer key of block `b` (ratio-4 layers).
    fn put_index_key(&mut self, l: usize, b: usize, k: &[f32]);
    fn index_key(&self, l: usize, b: usize) -> &[f32];
}

/// What one sequence keeps per layer, whole.
#[derive(Default)]
struct LayerState {
    raw: Vec<Vec<f32>>,
    rows: Vec<(Vec<f32>, Vec<f32>)>,
    index_rows: Vec<(Vec<f32>, Vec<f32>)>,
    blocks: Vec<Vec<f32>>,
    index_keys: Vec<Vec<f32>>,
}

/// A sequence's state held whole (the reference), and its next position.
pub struct Dsv4State {
    layers: Vec<LayerState>,
    pub(crate) pos: usize,
}

impl Dsv4State {
    pub(crate) fn new(layers: usize) -> Dsv4State {
        Dsv4State {
            layers: (0..layers).map(|_| LayerState::default()).collect(),
            pos: 0,
        }
    }
}

/// Stores `v` at index `i` of a list written in order.
fn put<T: Default>(list: &mut Vec<T>, i: usize, v: T) {
    if list.len() <= i {
        list.resize_with(i + 1, T::default);
    }
    list[i] = v;
}

impl Store for Dsv4State {
    fn put_raw(&mut self, l: usize, p: usize, k: &[f32]) {
        put(&mut self.layers[l].raw, p, k.to_vec());
    }
    fn raw(&self, l: usize, p: usize) -> &[f32] {
        &self.layers[l].raw[p]
    }
    fn put_row(&mut self, l: usize, which: Rows, p: usize, kv: &[f32], sc: &[f32]) {
        let s = &mut self.layers[l];
        let list = match which {
            Rows::Attn => &mut s.rows,
            Rows::Index => &mut s.index_rows,
        };
        put(list, p, (kv.to_vec(), sc.to_vec()));
    }
    fn row(&self, l: usize, which: Rows, p: usize) -> (&[f32], &[f32]) {
        let s = &self.layers[l];
        let r = match which {
            Rows::Attn => &s.rows[p],
            Rows::Index => &s.index_rows[p],
        };
        (&r.0, &r.1)
    }
    fn put_block(&mut self, l: usize, b: usize, k: &[f32]) {
        put(&mut self.layers[l].blocks, b, k.to_vec());
    }
    fn block(&self, l: usize, b: usize) -> &[f32] {
        &self.layers[l].blocks[b]
    }
    fn put_index_key(&mut self, l: usize, b: usize, k: &[f32]) {
        put(&mut self.layers[l].index_keys, b, k.to_vec());
    }
    fn index_key(&self, l: usize, b: usize) -> &[f32] {
        &self.layers[l].index_keys[b]
    }
}
