//! Whether a model file splits over a number of ranks, from its header alone, as loading it
//! would split it: `strata plan` and `strata up`'s preflight refuse what `strata serve` would.

/// Whether the model at `path` splits over `tp` ranks, read from its header alone, as loading
/// it would split it (llama: `shard::Part::split`; DeepSeek-V4: its own parts): `strata plan` and
/// `strata up`'s preflight refuse what `strata serve` would. The reason names `--tp-size`.
pub fn check_tp_split(path: &std::path::Path, tp: usize) -> Result<(), crate::ModelError> {
    let header = crate::GgufHeader::open(path)?;
    if header.architecture() == Some("deepseek4") {
        let c = crate::deepseek4::load::read_dsv4_config(path)?;
        crate::deepseek4::part::Dsv4Part::split(&c, tp).map(|_| ())
    } else {
        // 32-column runs: the block a down projection always allows (a K-quant's 256 is taken
        // only where that also splits, so this accepts exactly what loading accepts).
        crate::shard::Part::split(&crate::Gguf::open(path)?.config, tp, 32).map(|_| ())
    }
}
