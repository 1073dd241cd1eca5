//! `strata-sim`: cache simulation over request traces.
//!
//! * [`trace`]: Mooncake-format traces with line- and field-precise errors.
//! * [`tokens`]: deterministic tokens per trace block.
//! * [`replay`]: the trace through the real tiered cache and policies.
//! * [`belady`]: offline MIN and infinite-cache bounds.
//! * [`sweep`]: miss-ratio curves over capacities, and their plot.
//! * [`plot`]: a dependency-free SVG line chart.

pub mod belady;
pub mod plot;
pub mod replay;
pub mod sweep;
pub mod tokens;
pub mod trace;
