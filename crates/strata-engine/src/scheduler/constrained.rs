//! Constrained requests in a step: their constraints are taken out of the requests that
//! choose a token after the model call, their masks computed on a helper thread while the
//! model runs, and put back with the masks for the sampler.

use crate::constraint::{guarded, TokenConstraint, TokenMask};

use super::Scheduler;

/// A constraint out of its request for the call: (index in the plan, the constraint).
pub(super) type Guest = (usize, Box<dyn TokenConstraint>);

/// Each guest's mask of the tokens allowed next (a failure fails its request only).
pub(super) fn masks_of(guests: &mut [Guest]) -> Vec<Result<TokenMask, String>> {
    guests
        .iter_mut()
        .map(|(_, c)| guarded(|| c.mask()))
        .collect()
}

/// Follows the chosen token; true when the output is then complete.
pub(super) fn commit(c: Option<&mut (dyn TokenConstraint + '_)>, t: u32) -> Result<bool, String> {
    match c {
        None => Ok(false),
        Some(c) => guarded(|| {
            c.commit(t)?;
            Ok(c.is_finished())
        }),
    }
}

impl Scheduler {
    /// Takes out the constraints of the plan's requests that choose a token after this call.
    pub(super) fn take_constraints(&mut self, plan: &[(usize, usize, usize)]) -> Vec<Guest> {
        let mut out = Vec::new();
        for (k, &(i, at, n)) in plan.iter().enumerate() {
            let r = &mut self.active[i];
            if at + n == r.tokens.len() {
                if let Some(c) = r.constraint.take() {
                    out.push((k, c));
                }
            }
        }
        out
    }

    /// Puts the constraints back; the masks by plan index (None: unconstrained or not
    /// choosing). A helper thread that died fails its requests.
    pub(super) fn put_back_constraints(
        &mut self,
        plan: &[(usize, usize, usize)],
        guests: Vec<Guest>,
        computed: Option<std::thread::Result<Vec<Result<TokenMask, String>>>>,
    ) -> Vec<Option<Result<TokenMask, String>>> {
        let mut masks: Vec<Option<Result<TokenMask, String>>> = vec![None; plan.len()];
        let mut results = match computed {
            Some(Ok(v)) => v.into_iter().map(Some).collect(),
            _ => vec![None; guests.len()],
        };
        for ((k, c), m) in guests.into_iter().zip(results.iter_mut()) {
            self.active[plan[k].0].constraint = Some(c);
            masks[k] = Some(
                m.take()
                    .unwrap_or_else(|| Err("the mask computation failed".into())),
            );
        }
        masks
    }
}
