//! One sequence of a forward call, and the checks every forward pass runs on it first.

use strata_kv::pool::DevicePool;
use strata_kv::Class;

use crate::error::ModelError;

/// One sequence of a forward call.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// Tokens to compute now.
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in its pages (the cached prefix and earlier chunks).
    pub pos: usize,
    /// Device pages holding positions `0..pos + tokens.len()`, in order.
    pub pages: &'a [u32],
    /// With a layout that has window kinds: the device window page of each page
    /// (`strata_kv::NO_PAGE` for a page older than every window read from `pos` on); empty
    /// otherwise.
    pub windows: &'a [u32],
    /// Generated tokens (a decode step) rather than prompt tokens. Decode steps of at most
    /// [`crate::llama::QUANTIZED_MAX_ROWS`] tokens may quantize their activations; prompt
    /// tokens always take the f32 panel product, which gives a row the same bits whatever
    /// else is in the call, so a prompt's logits (and first token) do not depend on how much
    /// of it was cached or how it was chunked.
    /// Their attention too: every prompt row takes the tile (a prompt's last token alone after
    /// a full prefix hit included), so a position's K/V are the same bits whether it ended an
    /// earlier prompt or sits inside a longer one.
    pub decode: bool,
}

impl SeqInput<'_> {
    /// The pages this call writes: those of positions `pos..pos + tokens.len()`.
    pub(crate) fn written(&self, ps: usize) -> std::ops::Range<usize> {
        if self.tokens.is_empty() {
            return 0..0;
        }
        self.pos / ps..(self.pos + self.tokens.len() - 1) / ps + 1
    }
}

/// Checks one sequence of a forward call against the pool and the model: its tokens fit the
/// context and its pages, its pages are in the pool, its tokens in the vocabulary, and the
/// pages whose window state the call reads or writes have window pages in the pool.
pub(crate) fn check_seq(
    pool: &DevicePool,
    si: usize,
    s: &SeqInput,
    context: usize,
    vocab: usize,
) -> Result<(), ModelError> {
    let err = |m: String| Err(ModelError::Forward(format!("sequence {si}: {m}")));
    let ps = pool.layout().page_size();
    let end = s.pos + s.tokens.len();
    if end > context {
        return err(format!("{end} tokens exceed the context length {context}"));
    }
    if s.pages.len() * ps < end {
        return err(format!(
            "{} pages of {ps} tokens cannot hold {end} tokens",
            s.pages.len()
        ));
    }
    if let Some(&p) = s.pages.iter().find(|&&p| p >= pool.pages()) {
        return err(format!("page {p} is outside the device pool"));
    }
    if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
        return err(format!("token id {t} is outside the vocabulary ({vocab})"));
    }
    let layout = pool.layout();
    if !layout.has_window() {
        if !s.windows.is_empty() {
            return err("window pages given for a layout without window kinds".into());
        }
        return Ok(());
    }
    if s.windows.len() != s.pages.len() {
        return err(format!(
            "{} window entries for {} pages",
            s.windows.len(),
            s.pages.len()
        ));
    }
    let first = s.pos.saturating_sub(layout.window_tokens()) / ps;
    let last = end.div_ceil(ps);
    let n = pool.count(Class::Window);
    if let Some(i) = (first..last).find(|&i| s.windows[i] >= n) {
        return err(format!(
            "page {i} (positions from {}) has no window page, but the window before position \
             {} reads it",
            i * ps,
            s.pos
        ));
    }
    Ok(())
}
