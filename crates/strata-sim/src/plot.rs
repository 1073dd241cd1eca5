//! A dependency-free SVG line chart (miss-ratio curves here; `strata bench`'s plots).

use std::fmt::Write;

use crate::sweep::SweepPoint;

const W: f64 = 760.0;
const H: f64 = 460.0;
const L: f64 = 70.0;
const R: f64 = 170.0;
const T: f64 = 46.0;
const B: f64 = 60.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
];

/// One line of a chart.
#[derive(Clone, Debug, Default)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub dashed: bool,
}

/// A line chart: axes with labelled ticks, one polyline (with point markers unless the series
/// is long) per series, a legend on the right.
#[derive(Clone, Debug, Default)]
pub struct Chart {
    pub title: String,
    /// A second, smaller title line (e.g. the workload's parameters).
    pub subtitle: String,
    pub x_label: String,
    pub y_label: String,
    /// Logarithmic x axis (values ≤ 0 are clamped to 1e-6).
    pub log_x: bool,
    /// Tick positions on x (default: round numbers over the data's range).
    pub x_ticks: Option<Vec<f64>>,
    /// y range (default: 0 to the data's maximum, rounded up).
    pub y_range: Option<(f64, f64)>,
    /// Appended to y tick labels (e.g. "%").
    pub y_unit: String,
    pub series: Vec<Series>,
}

/// About `n` round tick values (1, 2 or 5 × 10^k apart) covering [lo, hi].
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= n as f64)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step + 1e-9).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// The plot area's data ranges and the mapping from data to SVG coordinates.
struct Frame {
    log_x: bool,
    /// x range, after the log transform when `log_x`.
    xmin: f64,
    xmax: f64,
    ymin: f64,
    ymax: f64,
}

impl Frame {
    /// The x value on the axis's scale (log10 when `log_x`).
    fn fx(&self, v: f64) -> f64 {
        if self.log_x {
            v.max(1e-6).log10()
        } else {
            v
        }
    }

    /// SVG x of data x `v`.
    fn x(&self, v: f64) -> f64 {
        let xspan = (self.xmax - self.xmin).max(1e-9);
        L + (self.fx(v) - self.xmin) / xspan * (W - L - R)
    }

    /// SVG y of data y `v`.
    fn y(&self, v: f64) -> f64 {
        let yspan = (self.ymax - self.ymin).max(1e-12);
        T + (1.0 - (v - self.ymin) / yspan) * (H - T - B)
    }
}

impl Chart {
    pub fn svg(&self) -> String {
        let f = self.frame();
        let mut s = String::new();
        let _ = write!(
            s,
            r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{0}" y="18" text-anchor="middle" font-size="15">{1}</text><text x="{0}" y="33" text-anchor="middle" font-size="11" fill="#555">{2}</text>"##,
            W / 2.0,
            esc(&self.title),
            esc(&self.subtitle)
        );
        self.grid(&f, &mut s);
        let _ = write!(
            s,
            r##"<line x1="{L}" x2="{L}" y1="{T}" y2="{0}" stroke="black"/><line x1="{L}" x2="{1}" y1="{0}" y2="{0}" stroke="black"/><text x="{2}" y="{3}" text-anchor="middle">{4}</text><text transform="translate(18,{5}) rotate(-90)" text-anchor="middle">{6}</text>"##,
            H - B,
            W - R,
            (W - R + L) / 2.0,
            H - 14.0,
            esc(&self.x_label),
            (H - B + T) / 2.0,
            esc(&self.y_label)
        );
        for (i, ser) in self.series.iter().enumerate() {
            series_svg(&f, i, ser, &mut s);
        }
        s.push_str("</svg>\n");
        s
    }

    /// The data ranges: x over all points, y from `y_range` or 0 to the rounded-up maximum.
    fn frame(&self) -> Frame {
        let pts = || self.series.iter().flat_map(|s| s.points.iter());
        let mut f = Frame {
            log_x: self.log_x,
            xmin: 0.0,
            xmax: 1.0,
            ymin: 0.0,
            ymax: 1.0,
        };
        let (xmin, xmax) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
            (a.min(f.fx(p.0)), b.max(f.fx(p.0)))
        });
        if xmin.is_finite() {
            (f.xmin, f.xmax) = (xmin, xmax);
        }
        (f.ymin, f.ymax) = self.y_range.unwrap_or_else(|| {
            let m = pts()
                .map(|p| p.1)
                .filter(|v| v.is_finite())
                .fold(0.0, f64::max);
            let t = nice_ticks(0.0, if m > 0.0 { m } else { 1.0 }, 5);
            let top = t.last().copied().unwrap_or(1.0);
            (0.0, if top < m { top + (t[1] - t[0]) } else { top })
        });
        f
    }

    /// Horizontal grid lines with y tick labels, then vertical ones with x tick labels.
    fn grid(&self, f: &Frame, s: &mut String) {
        for v in nice_ticks(f.ymin, f.ymax, 10) {
            let _ = write!(
                s,
                r##"<line x1="{L}" x2="{0}" y1="{1}" y2="{1}" stroke="#ddd"/><text x="{2}" y="{3}" text-anchor="end">{4}{5}</text>"##,
                W - R,
                f.y(v),
                L - 6.0,
                f.y(v) + 4.0,
                trim(v),
                esc(&self.y_unit)
            );
        }
        let xt = self.x_ticks.clone().unwrap_or_else(|| {
            if self.log_x {
                (f.xmin.floor() as i32..=f.xmax.ceil() as i32)
                    .flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e)))
                    .filter(|&v| f.fx(v) >= f.xmin - 1e-9 && f.fx(v) <= f.xmax + 1e-9)
                    .collect()
            } else {
                nice_ticks(f.xmin, f.xmax, 8)
            }
        });
        for v in xt {
            let _ = write!(
                s,
                r##"<line x1="{0}" x2="{0}" y1="{T}" y2="{1}" stroke="#eee"/><text x="{0}" y="{2}" text-anchor="middle">{3}</text>"##,
                f.x(v),
                H - B,
                H - B + 16.0,
                trim(v)
            );
        }
    }
}

/// Series `i`: its polyline, point markers unless it is long, and its legend entry.
fn series_svg(f: &Frame, i: usize, ser: &Series, s: &mut String) {
    let c = COLORS[i % COLORS.len()];
    let d: Vec<String> = ser
        .points
        .iter()
        .filter(|p| p.1.is_finite())
        .map(|&(a, b)| format!("{:.1},{:.1}", f.x(a), f.y(b)))
        .collect();
    let dash = if ser.dashed {
        r#" stroke-dasharray="6 4""#
    } else {
        ""
    };
    let _ = write!(
        s,
        r#"<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="{}"/>"#,
        d.join(" ")
    );
    if ser.points.len() <= 40 {
        for &(a, b) in ser.points.iter().filter(|p| p.1.is_finite()) {
            let _ = write!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#,
                f.x(a),
                f.y(b)
            );
        }
    }
    let ly = T + 10.0 + i as f64 * 20.0;
    let _ = write!(
        s,
        r#"<line x1="{0}" x2="{1}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/><text x="{2}" y="{3}">{4}</text>"#,
        W - R + 12.0,
        W - R + 36.0,
        W - R + 42.0,
        ly + 4.0,
        esc(&ser.name)
    );
}

/// Hit rate (%) against capacity (% of distinct pages, log scale).
pub fn sweep_svg(title: &str, pts: &[SweepPoint]) -> String {
    let pct = |f: f64| f * 100.0;
    let mut series: Vec<Series> = Vec::new();
    if let Some(first) = pts.first() {
        for (i, (pol, _)) in first.policies.iter().enumerate() {
            series.push(Series {
                name: pol.name().to_uppercase(),
                points: pts
                    .iter()
                    .map(|p| (pct(p.fraction), pct(p.policies[i].1)))
                    .collect(),
                dashed: false,
            });
        }
    }
    series.push(Series {
        name: "Belady (offline MIN)".into(),
        points: pts
            .iter()
            .map(|p| (pct(p.fraction), pct(p.belady)))
            .collect(),
        dashed: true,
    });
    series.push(Series {
        name: "infinite cache".into(),
        points: pts
            .iter()
            .map(|p| (pct(p.fraction), pct(p.infinite)))
            .collect(),
        dashed: true,
    });
    Chart {
        title: title.into(),
        subtitle: String::new(),
        x_label: "cache capacity (% of the trace's distinct pages, log scale)".into(),
        y_label: "hit rate (% of prompt tokens)".into(),
        log_x: true,
        x_ticks: Some(pts.iter().map(|p| pct(p.fraction)).collect()),
        y_range: Some((0.0, 100.0)),
        y_unit: "%".into(),
        series,
    }
    .svg()
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
        assert!(svg.contains(">100%<") && svg.contains(">10<"));
    }

    #[test]
    fn nice_ticks_are_round_and_cover_the_range() {
        assert_eq!(
            nice_ticks(0.0, 100.0, 10),
            (0..=10).map(|i| i as f64 * 10.0).collect::<Vec<_>>()
        );
        assert_eq!(nice_ticks(0.0, 7.3, 5), vec![0.0, 2.0, 4.0, 6.0]);
        assert_eq!(nice_ticks(0.5, 3.0, 5), vec![0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
    }

    #[test]
    fn a_linear_chart_places_points_inside_the_axes() {
        let c = Chart {
            title: "x".into(),
            series: vec![Series {
                name: "a".into(),
                points: vec![(0.0, 0.0), (10.0, 5.0)],
                dashed: false,
            }],
            ..Chart::default()
        };
        let svg = c.svg();
        // First point at the origin (left, bottom), last at the right end.
        assert!(
            svg.contains(&format!(r#"cx="{L:.1}" cy="{:.1}""#, H - B)),
            "{svg}"
        );
        assert!(svg.contains(&format!(r#"cx="{:.1}""#, W - R)), "{svg}");
    }
}
