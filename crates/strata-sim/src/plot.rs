//! A dependency-free SVG line chart for miss-ratio curves.

use std::fmt::Write;

use crate::sweep::SweepPoint;

const W: f64 = 760.0;
const H: f64 = 460.0;
const L: f64 = 70.0;
const R: f64 = 170.0;
const T: f64 = 40.0;
const B: f64 = 60.0;
const COLORS: [&str; 4] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/// Hit rate (%) against capacity (% of distinct pages, log scale).
pub fn sweep_svg(title: &str, pts: &[SweepPoint]) -> String {
    let xmin = pts
        .iter()
        .map(|p| p.fraction)
        .fold(f64::INFINITY, f64::min)
        .max(1e-6)
        .log10();
    let xmax = pts
        .iter()
        .map(|p| p.fraction)
        .fold(0.0, f64::max)
        .max(1e-6)
        .log10();
    let span = (xmax - xmin).max(1e-9);
    let x = |f: f64| L + (f.max(1e-6).log10() - xmin) / span * (W - L - R);
    let y = |r: f64| T + (1.0 - r) * (H - T - B);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        (W - R + L) / 2.0,
        esc(title)
    );
    for i in 0..=10 {
        let r = i as f64 / 10.0;
        let _ = write!(
            s,
            r##"<line x1="{L}" x2="{0}" y1="{1}" y2="{1}" stroke="#ddd"/><text x="{2}" y="{3}" text-anchor="end">{4}%</text>"##,
            W - R,
            y(r),
            L - 6.0,
            y(r) + 4.0,
            i * 10
        );
    }
    for p in pts {
        let _ = write!(
            s,
            r##"<line x1="{0}" x2="{0}" y1="{T}" y2="{1}" stroke="#eee"/><text x="{0}" y="{2}" text-anchor="middle">{3}%</text>"##,
            x(p.fraction),
            H - B,
            H - B + 16.0,
            trim(p.fraction * 100.0)
        );
    }
    let _ = write!(
        s,
        r##"<line x1="{L}" x2="{L}" y1="{T}" y2="{0}" stroke="black"/><line x1="{L}" x2="{1}" y1="{0}" y2="{0}" stroke="black"/><text x="{2}" y="{3}" text-anchor="middle">cache capacity (% of the trace's distinct pages, log scale)</text><text transform="translate(18,{4}) rotate(-90)" text-anchor="middle">hit rate (% of prompt tokens)</text>"##,
        H - B,
        W - R,
        (W - R + L) / 2.0,
        H - 14.0,
        (H - B + T) / 2.0
    );
    let mut series: Vec<(String, Vec<f64>, bool)> = Vec::new();
    if let Some(first) = pts.first() {
        for (i, (pol, _)) in first.policies.iter().enumerate() {
            series.push((
                pol.name().to_uppercase(),
                pts.iter().map(|p| p.policies[i].1).collect(),
                false,
            ));
        }
    }
    series.push((
        "Belady (offline MIN)".into(),
        pts.iter().map(|p| p.belady).collect(),
        true,
    ));
    series.push((
        "infinite cache".into(),
        pts.iter().map(|p| p.infinite).collect(),
        true,
    ));
    for (i, (name, ys, dashed)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let d: Vec<String> = pts
            .iter()
            .zip(ys)
            .map(|(p, &r)| format!("{:.1},{:.1}", x(p.fraction), y(r)))
            .collect();
        let dash = if *dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="{}"/>"#,
            d.join(" ")
        );
        for (p, &r) in pts.iter().zip(ys) {
            let _ = write!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#,
                x(p.fraction),
                y(r)
            );
        }
        let ly = T + 10.0 + i as f64 * 20.0;
        let _ = write!(
            s,
            r#"<line x1="{0}" x2="{1}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/><text x="{2}" y="{3}">{4}</text>"#,
            W - R + 12.0,
            W - R + 36.0,
            W - R + 42.0,
            ly + 4.0,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn trim(v: f64) -> String {
    let t = format!("{v:.2}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn esc(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_kv::EvictionPolicy;

    #[test]
    fn svg_has_every_series_and_point() {
        let pts: Vec<SweepPoint> = [0.01, 0.1, 1.0]
            .iter()
            .map(|&f| SweepPoint {
                fraction: f,
                capacity_tokens: 1,
                policies: vec![
                    (EvictionPolicy::Lru, f / 2.0),
                    (EvictionPolicy::Gdsf, f / 1.5),
                ],
                belady: f,
                infinite: 1.0,
            })
            .collect();
        let svg = sweep_svg("t <x>", &pts);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert_eq!(svg.matches("<circle").count(), 12);
        assert!(svg.contains("t &lt;x&gt;") && svg.contains(">LRU<") && svg.contains(">GDSF<"));
    }
}
