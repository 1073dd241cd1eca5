//! `strata-mem`: memory you can trust.
//!
//! * [`topology`]: NUMA nodes, CPUs and memory from sysfs (fake trees in tests).
//! * [`model`]: a model's pool kinds per rank under tensor parallelism; presets.
//! * [`plan`]: the sizing planner: every number, which flag decided it, validated before any
//!   allocation, with warnings such as the ratio-sized tiny host pool.
//! * [`numa`]: NUMA-bound, pre-faulted, verified host pools (a `HostAllocator`).

pub mod model;
pub mod numa;
pub mod plan;
pub mod topology;

pub use model::{dsv4_kinds, preset, Dsv4Shape, KindSpec, ModelSpec, Needed, Per, PRESETS};
pub use numa::{NumaAllocator, Placement};
pub use plan::{
    make_plan, Copies, DeviceBudget, HostBudget, NumaChoice, NumaPolicy, Plan, PlanError,
    PlanRequest, Scratch,
};
pub use topology::{Node, Topology};
