//! `GET /cache/curve`: the worker's live miss-ratio curve as JSON ([`CurveReport`]), the same
//! figures `/metrics` shows as `strata_cache_curve_*`. Not found when the worker keeps none
//! (`--curve-pages 0`).

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use strata_kv::cache::curve::Curve;
use strata_protocol::{CurveGain, CurvePointReport, CurveReport};

use crate::error::ApiError;
use crate::state::AppState;

/// The worker's curve, or 404 when it keeps none.
pub async fn curve(
    State(st): State<Arc<AppState>>,
    uri: axum::http::Uri,
) -> Result<Json<CurveReport>, ApiError> {
    crate::error::query::<crate::error::NoQuery>(&uri)?;
    let s = st.engine.snapshot();
    let Some(c) = &s.curve else {
        return Err(ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "not_found_error",
            "this worker keeps no miss-ratio curve (started with --curve-pages 0)",
        ));
    };
    let ranks = st.plan.as_ref().map_or(1, |p| p.ranks.max(1) as usize);
    Ok(Json(report(c, &st.role, st.engine.info().page_size, ranks)))
}

/// The report of curve `c`.
pub fn report(c: &Curve, role: &str, page_size: usize, ranks: usize) -> CurveReport {
    CurveReport {
        role: role.to_string(),
        policy: c.policy.to_string(),
        page_size,
        ranks,
        sample_rate: c.rate,
        references: c.references,
        window_references: c.window_references,
        tracked_pages: c.tracked_pages as u64,
        memory_bytes: c.memory_bytes as u64,
        prompt_tokens_per_second: c.prompt_tokens_per_second,
        unbounded_hit_ratio: c.unbounded_hit_ratio,
        points: c
            .points
            .iter()
            .map(|p| CurvePointReport {
                tier: p.tier.to_string(),
                scale: p.scale,
                pages: p.pages,
                bytes: p.bytes,
                hit_ratio: p.hit_ratio,
                belady: p.belady,
            })
            .collect(),
        gains: c
            .gains
            .iter()
            .map(|g| CurveGain {
                tier: g.tier.to_string(),
                added_bytes: g.added_bytes,
                hit_ratio: g.hit_ratio,
                hit_ratio_after: g.hit_ratio_after,
                saved_prompt_tokens_per_second: g.saved_prompt_tokens_per_second,
            })
            .collect(),
    }
}
