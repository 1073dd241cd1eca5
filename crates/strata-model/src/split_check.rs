//! Whether a model splits over a number of ranks, from its header alone, as loading it would
//! split it: `strata plan` and `strata up`'s preflight refuse what `strata serve` would.

use crate::scratch::ModelShape;

impl ModelShape {
    /// Whether this model splits over `tp` ranks as loading it would split it (llama:
    /// `shard::Part::split`; DeepSeek-V4: its own parts). The reason names `--tp-size`.
    pub fn check_tp_split(&self, tp: usize) -> Result<(), crate::ModelError> {
        match self {
            ModelShape::Dsv4(c) => crate::deepseek4::part::Dsv4Part::split(c, tp).map(|_| ()),
            // 32-column runs: the block a down projection always allows (a K-quant's 256 is
            // taken only where that also splits, so this accepts exactly what loading accepts).
            ModelShape::Llama(c) => crate::shard::Part::split(c, tp, 32).map(|_| ()),
        }
    }
}
