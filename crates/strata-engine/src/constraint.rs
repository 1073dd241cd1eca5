//! Constrained decoding, as the engine sees it: a request may carry a [`Constraint`] (a
//! grammar compiled elsewhere — `strata-grammar` builds them with llguidance); each of its
//! requests runs one [`TokenConstraint`], which says which tokens may come next and follows
//! the tokens chosen.
//!
//! The engine knows nothing of grammars: it asks for a [`TokenMask`] before each choice (on a
//! helper thread, while the model computes the batch's logits), masks the logits, and commits
//! the token chosen. A constraint that panics fails its own request, never the engine.

use std::any::Any;
use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

/// Which tokens may come next: a bit per token id (bit `t % 32` of word `t / 32`), and
/// whether the output may end here (then the model's stop tokens are allowed).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenMask {
    pub words: Vec<u32>,
    pub can_end: bool,
}

impl TokenMask {
    pub fn allows(&self, t: u32) -> bool {
        self.words
            .get(t as usize / 32)
            .is_some_and(|w| w >> (t % 32) & 1 == 1)
    }

    /// Sets every disallowed logit to −∞; the stop tokens follow `can_end`.
    pub fn apply(&self, logits: &mut [f32], stops: &[u32]) {
        let kept: Vec<(usize, f32)> = stops
            .iter()
            .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
            .collect();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = self.words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits >> b & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for (t, l) in kept {
            logits[t] = if self.can_end { l } else { f32::NEG_INFINITY };
        }
    }

    /// Whether a token other than `ends` may come (the answer can go on).
    pub fn allows_besides(&self, ends: &[u32]) -> bool {
        self.words.iter().enumerate().any(|(i, &w)| {
            let held = ends
                .iter()
                .filter(|&&t| t as usize / 32 == i)
                .fold(0u32, |m, &t| m | 1 << (t % 32));
            w & !held != 0
        })
    }

    /// Whether any token at all may come (a stop token counts when the output may end).
    pub fn any(&self) -> bool {
        self.can_end || self.words.iter().any(|&w| w != 0)
    }
}

/// One request's constraint while it generates.
pub trait TokenConstraint: Send {
    /// The tokens that may come next.
    fn mask(&mut self) -> Result<TokenMask, String>;
    /// Follows the chosen (allowed) token.
    fn commit(&mut self, token: u32) -> Result<(), String>;
    /// Nothing more may follow: the output is complete.
    fn is_finished(&self) -> bool;
}

/// A compiled constraint, shared by the requests (and choices) that use it.
pub trait ConstraintSource: Send + Sync {
    /// A fresh constraint for one request.
    fn start(&self) -> Box<dyn TokenConstraint>;
    /// What it is, for logs.
    fn describe(&self) -> String;
    /// The concrete type (the server reads back what it compiled, e.g. to send it to a
    /// prefill worker).
    fn as_any(&self) -> &dyn Any;
}

/// A request's constraint (cheap to clone; equal when it is the same compiled constraint).
#[derive(Clone)]
pub struct Constraint(pub Arc<dyn ConstraintSource>);

impl PartialEq for Constraint {
    fn eq(&self, o: &Constraint) -> bool {
        Arc::ptr_eq(&self.0, &o.0)
    }
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Constraint({})", self.0.describe())
    }
}

thread_local! {
    /// Set while a constraint's code runs on this thread: its panics are its request's failure.
    static GUEST: Cell<bool> = const { Cell::new(false) };
}

/// Whether the current thread is running a constraint's code (the engine's panic hook lets
/// such panics pass: they fail one request).
pub(crate) fn in_guest() -> bool {
    GUEST.with(|g| g.get())
}

/// Runs a constraint's code; a panic becomes an error.
pub(crate) fn guarded<R>(f: impl FnOnce() -> Result<R, String>) -> Result<R, String> {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            GUEST.with(|g| g.set(self.0));
        }
    }
    let _reset = Reset(GUEST.with(|g| g.replace(true)));
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(format!(
            "the output constraint failed: {}",
            panic_message(&*p)
        )),
    }
}

/// The message of a panic's payload.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_keeps_only_allowed_tokens_and_stops_when_it_may_end() {
        // Tokens 1 and 33 allowed; 40 tokens; stop token 39.
        let m = TokenMask {
            words: vec![1 << 1, 1 << 1],
            can_end: false,
        };
        assert!(m.allows(1) && m.allows(33) && !m.allows(0) && !m.allows(64));
        let mut l = vec![0.0f32; 40];
        m.apply(&mut l, &[39]);
        let open: Vec<usize> = (0..40).filter(|&i| l[i].is_finite()).collect();
        assert_eq!(open, vec![1, 33]);
        let mut l = vec![0.0f32; 40];
        TokenMask { can_end: true, ..m }.apply(&mut l, &[39]);
        let open: Vec<usize> = (0..40).filter(|&i| l[i].is_finite()).collect();
        assert_eq!(open, vec![1, 33, 39]);
        assert!(!TokenMask::default().any());
    }

    #[test]
    fn a_panicking_constraint_is_an_error_not_an_unwind() {
        let r: Result<(), String> = guarded(|| panic!("boom"));
        assert!(r.unwrap_err().contains("boom"));
        assert!(!in_guest());
    }
}
