//! Window residency: how many window pages each tier gets, and how often a committed prefix
//! keeps its window state (the checkpoint interval K), with the plan's lines about it.
//!
//! A window kind (DeepSeek-V4's sliding-window K/V and compressor rows) is read only for the
//! `w` tokens before the position a request continues from. By default (no
//! `--window-tokens-ratio`):
//! * a running request holds its window state in a ring of `⌈w / page⌉ + 1` pages, so the
//!   device keeps `--max-running` rings plus the pages of one batch
//!   (`--max-batch-tokens`), at most half the device budget;
//! * a committed prefix keeps its window state at its end (and its prompt's end), its branch
//!   point, its shared system prompt's end and every K pages, so the host keeps
//!   `--max-running` sequence ends, a span for a shared system prompt, and a checkpoint span
//!   every K main pages, [`WINDOW_HOST_SHARE`] of the host budget in all; K follows from that share
//!   unless `--window-checkpoint-pages` sets it.

use strata_kv::units::format_bytes;

use super::cost::{Cost, Share};
use super::{Decision, PlanError, PlanRequest};

/// The share of a host budget the window pages take by default (sequence ends and
/// checkpoints).
pub const WINDOW_HOST_SHARE: f64 = 0.09;

/// The model's window geometry in pages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    /// Tokens of the widest window.
    pub(crate) w: u64,
    ps: u64,
}

impl Geometry {
    pub(crate) fn new(req: &PlanRequest) -> Geometry {
        let w = req
            .model
            .kinds
            .iter()
            .filter_map(|k| match k.needed {
                crate::model::Needed::Window(n) => Some(n),
                crate::model::Needed::Prefix => None,
            })
            .max()
            .unwrap_or(0) as u64;
        Geometry {
            w,
            ps: req.page_size as u64,
        }
    }

    /// Pages a checkpoint keeps (those covering the window before it).
    fn span(&self) -> u64 {
        self.w.div_ceil(self.ps)
    }

    /// Pages of a running request's ring: its window and the page being written.
    fn ring(&self) -> u64 {
        self.span() + 1
    }

    /// Pages a committed sequence keeps at its end: those covering `[end − 1 − w, end)`, and
    /// one more for its prompt's end (`[p − w, p)`, a page before it after a short answer; a
    /// longer answer's prompt end is a checkpoint's worth on its own).
    fn end(&self) -> u64 {
        (self.w + 1).div_ceil(self.ps) + 1
    }
}

/// The window plan: each tier's share and the checkpoint interval (0: every page keeps its
/// window state).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WindowPlan {
    pub(crate) device: Share,
    pub(crate) host: Share,
    pub(crate) k: u64,
    /// Whether the checkpoint residency is the default (no ratio, no K of 0).
    residency: bool,
}

/// Checks the window flags against the model.
pub(crate) fn validate(req: &PlanRequest, cost: &Cost) -> Result<(), PlanError> {
    if cost.window > 0 {
        return Ok(());
    }
    let model = req.model.name.clone();
    if let Some(ratio) = req.window_ratio {
        return Err(PlanError::NoWindowKinds { ratio, model });
    }
    match req.window_checkpoint_pages {
        Some(k) if k > 0 => Err(PlanError::CheckpointsWithoutWindowKinds { k, model }),
        _ => Ok(()),
    }
}

/// The device's share: with the default residency, rings for the running requests and one
/// batch, at most half of `budget`.
pub(crate) fn device_share(
    req: &PlanRequest,
    cost: &Cost,
    budget: u64,
    decided: &mut Vec<Decision>,
    warnings: &mut Vec<String>,
) -> Result<WindowPlan, PlanError> {
    let every = WindowPlan {
        device: Share::Ratio(1.0),
        host: Share::Ratio(1.0),
        k: 0,
        residency: false,
    };
    if cost.window == 0 {
        return Ok(every);
    }
    if let Some(r) = req.window_ratio {
        let k = req.window_checkpoint_pages.unwrap_or(0);
        return Ok(WindowPlan {
            device: Share::Ratio(r),
            host: Share::Ratio(r),
            k,
            residency: false,
        });
    }
    if req.window_checkpoint_pages == Some(0) {
        decided.push(Decision {
            what: "window kinds' tokens per rank".into(),
            by: "--window-checkpoint-pages 0: every page keeps its window kinds (on device too: the longest request is the device's window tokens)".into(),
        });
        return Ok(every);
    }
    let g = Geometry::new(req);
    let ps = req.page_size as u64;
    let rings = req.max_running * g.ring() + req.max_batch_tokens.div_ceil(ps);
    // At most half the budget, but always one ring (a small budget then holds few tokens).
    let cap = (budget / 2 / cost.window_page()).max(g.ring());
    let fixed = rings.min(cap);
    if g.ring() * cost.window_page() >= budget {
        return Err(PlanError::NoWindowRing {
            budget: format_bytes(budget),
            ring: g.ring(),
            bytes: format_bytes(g.ring() * cost.window_page()),
        });
    }
    let held = (fixed - req.max_batch_tokens.div_ceil(ps).min(fixed)) / g.ring();
    if fixed < rings {
        warnings.push(format!(
            "window state: --max-running {} requests need {rings} window pages of {} on device (rings of {} pages and one batch), more than half the device budget ({fixed} pages, at least one ring): about {} requests compute at once; give a larger --device-mem or a smaller --max-running",
            req.max_running,
            format_bytes(cost.window_page()),
            g.ring(),
            held.max(1)
        ));
    }
    decided.push(Decision {
        what: "device window pages per rank".into(),
        by: format!(
            "no --window-tokens-ratio: a running request holds its window state ({} tokens before the position it computes) in a ring of {} pages: --max-running {} × {} + --max-batch-tokens {} / {ps} = {rings} pages{}, {}; the longest request is bounded by the main pages only",
            g.w,
            g.ring(),
            req.max_running,
            g.ring(),
            req.max_batch_tokens,
            if fixed < rings { format!(", capped at half the device budget (at least one ring): {fixed}") } else { String::new() },
            format_bytes(fixed * cost.window_page()),
        ),
    });
    Ok(WindowPlan {
        device: Share::Pages {
            fixed,
            k: 0,
            span: 0,
        },
        host: Share::Ratio(1.0),
        k: 0,
        residency: true,
    })
}

/// The host's share and K for a host budget of `budget` bytes per rank (None: no host tier,
/// with `device_pages` main pages on device).
pub(crate) fn host_share(
    req: &PlanRequest,
    cost: &Cost,
    plan: &mut WindowPlan,
    budget: Option<u64>,
    device_pages: u64,
    decided: &mut Vec<Decision>,
) {
    if !plan.residency {
        return;
    }
    let g = Geometry::new(req);
    let wp = cost.window_page();
    let Some(budget) = budget.filter(|&b| b > 0) else {
        // No host tier: the device's window pages hold the rings and what ends they can.
        plan.k = req.window_checkpoint_pages.unwrap_or(device_pages.max(1));
        plan.host = Share::Pages {
            fixed: 0,
            k: 0,
            span: 0,
        };
        checkpoint_decision(req, cost, plan, None, decided);
        return;
    };
    // Never more than half the budget; ends first (and one span for the system prompt they
    // share), then checkpoints.
    let cap = budget / 2 / wp;
    let ends = (req.max_running * g.end()).min(cap.saturating_sub(g.span()));
    let share = (budget as f64 * WINDOW_HOST_SHARE) as u64 / wp;
    let pages = share.max(ends + g.span()).min(cap);
    let k = match req.window_checkpoint_pages {
        Some(k) => k,
        None => {
            let main_pages = budget.saturating_sub(pages * wp) / (cost.main * g.ps).max(1);
            let checkpoints = (pages - ends.min(pages)) / g.span().max(1);
            if checkpoints == 0 {
                main_pages.max(1)
            } else {
                main_pages.div_ceil(checkpoints).max(1)
            }
        }
    };
    plan.k = k;
    plan.host = Share::Pages {
        fixed: ends,
        k,
        span: g.span(),
    };
    checkpoint_decision(req, cost, plan, Some((budget, ends)), decided);
}

/// The plan's line on the host's window pages and K: what they hold, what K costs and saves.
fn checkpoint_decision(
    req: &PlanRequest,
    cost: &Cost,
    plan: &WindowPlan,
    host: Option<(u64, u64)>,
    decided: &mut Vec<Decision>,
) {
    let g = Geometry::new(req);
    let (k, ps) = (plan.k, g.ps);
    let by_k = match req.window_checkpoint_pages {
        Some(_) => format!("--window-checkpoint-pages {k}"),
        None => "derived (--window-checkpoint-pages overrides)".into(),
    };
    let Some((budget, ends)) = host else {
        decided.push(Decision {
            what: "window checkpoints".into(),
            by: format!("{by_k}: every {k} pages; no host tier: committed prefixes keep their window state at their end and branch point while the device's window pages allow"),
        });
        return;
    };
    let h = cost.with(plan.host);
    let main = h.tokens_for(budget);
    let windows = h.window_tokens(main) / ps;
    let wp = cost.window_page();
    // Halving K: one more checkpoint span every K pages.
    let more = (main / ps).div_ceil(k.max(1)) * g.span() * wp;
    decided.push(Decision {
        what: "host window pages per rank".into(),
        by: format!(
            "{windows} pages, {} ({:.1}% of the host budget): {} sequence ends × {} pages (--max-running {}: a conversation or agent continues at its end or its prompt's end) + a checkpoint of {} pages every {k} pages ({} tokens, {by_k}) over the {main} main tokens; a hit that ends between checkpoints resumes from the one before it and recomputes up to {} tokens (half that on average); halving the interval would cost {} more (= {} fewer host tokens)",
            format_bytes(windows * wp),
            (windows * wp) as f64 * 100.0 / budget as f64,
            ends / g.end().max(1),
            g.end(),
            req.max_running,
            g.span(),
            k * ps,
            k * ps,
            format_bytes(more),
            more / cost.main.max(1) / ps * ps,
        ),
    });
}

/// With `--window-tokens-ratio`: states how many tokens keep their window state; refuses a
/// ratio that leaves no window page on device (a request computes into one per page).
pub(crate) fn window_decisions(
    req: &PlanRequest,
    device_tokens: u64,
    device_window: u64,
    decided: &mut Vec<Decision>,
) -> Result<(), PlanError> {
    let Some(r) = req.window_ratio else {
        return Ok(());
    };
    if device_window == 0 {
        return Err(PlanError::NoWindowPage {
            ratio: r,
            tokens: (device_tokens as f64 * r) as u64,
            page_size: req.page_size,
        });
    }
    let longest = match req.window_checkpoint_pages {
        Some(k) if k > 0 => "a running request holds its window state in a ring".to_string(),
        _ => format!("the longest request is {device_window} tokens"),
    };
    decided.push(Decision {
        what: "window kinds' tokens per rank".into(),
        by: format!(
            "--window-tokens-ratio {r}: window kinds (read only for the last tokens before a continuation) in {device_window} of the {device_tokens} device tokens per rank, the same share on host; {longest}"
        ),
    });
    Ok(())
}

/// How the kinds share the tokens (several kinds only).
pub(crate) fn kinds_decision(cost: &Cost, n: usize, ps: u64, decided: &mut Vec<Decision>) {
    if n > 1 {
        let by = if cost.window > 0 {
            format!("--page-size {ps}: a page holds every main kind (block kinds packed per page) and a window page every window kind, so each main kind gets the main tokens above and each window kind the window pages' tokens, at its bytes/token, inside the same budgets")
        } else {
            format!("--page-size {ps}: one page holds every kind (block kinds packed per page), so each kind gets the tokens above at its bytes/token, inside the same budgets")
        };
        decided.push(Decision {
            what: format!("each of the {} pool kinds' tokens per rank", n),
            by,
        });
    }
}
