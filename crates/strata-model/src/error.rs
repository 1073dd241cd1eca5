//! Errors of the model runtime.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("cannot open model {path}: {reason}")]
    Open { path: String, reason: String },
    #[error("{path} is not a readable GGUF file: {reason}")]
    NotGguf { path: String, reason: String },
    #[error("{path}: architecture `{found}` is not supported (supported: `llama`, `deepseek4`)")]
    Architecture { path: String, found: String },
    #[error("{path}: metadata `{key}`: {reason}")]
    Metadata {
        path: String,
        key: String,
        reason: String,
    },
    #[error("{path}: tensor `{name}`: {reason}")]
    Tensor {
        path: String,
        name: String,
        reason: String,
    },
    #[error("{path} is truncated: tensor data needs {need} bytes, the file has {have}")]
    Truncated { path: String, need: u64, have: u64 },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("model fetch: {0}")]
    Fetch(String),
    #[error("forward pass: {0}")]
    Forward(String),
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A flag's value this model cannot take (the message names the flag).
    #[error("{0}")]
    Flag(String),
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::Forward(e.to_string().lines().next().unwrap_or("").to_string())
    }
}
