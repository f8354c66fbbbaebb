//! `ferry bench --plot FILE.svg`: GB/s against block size, one line per
//! series (ferry's WRITE and READ, and the run's reference beside them), as
//! a self-contained SVG.

use std::fmt::Write as _;

use crate::args::fmt_size;

/// One line of the chart: (block bytes, GB/s) points.
pub struct Series {
    pub name: String,
    pub points: Vec<(usize, f64)>,
    /// Drawn dashed (a reference, not ferry).
    pub reference: bool,
}

/// Adds (x, y) to the series called `name`, making it if new.
pub fn add_point(series: &mut Vec<Series>, name: String, reference: bool, x: usize, y: f64) {
    match series.iter_mut().find(|s| s.name == name) {
        Some(s) => s.points.push((x, y)),
        None => series.push(Series {
            name,
            points: vec![(x, y)],
            reference,
        }),
    }
}

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A "nice" step for about `n` ticks up to `max`.
fn tick_step(max: f64, n: f64) -> f64 {
    let raw = (max / n).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag)
}

/// What the x axis shows: its name and how a value is written.
pub struct XAxis {
    pub name: &'static str,
    pub label: fn(usize) -> String,
}

/// Block sizes (the default chart).
pub const BLOCK_SIZE: XAxis = XAxis {
    name: "block size",
    label: fmt_size,
};

/// Renders the chart (x on a log2 scale); `title` goes on top.
pub fn svg(title: &str, axis: &XAxis, series: &[Series]) -> String {
    let pts = || series.iter().flat_map(|s| s.points.iter());
    let (xmin, xmax) = pts().fold((f64::MAX, f64::MIN), |(a, b), &(x, _)| {
        let l = (x as f64).log2();
        (a.min(l), b.max(l))
    });
    let (xmin, xmax) = if xmin > xmax {
        (0.0, 1.0)
    } else if xmin == xmax {
        (xmin - 1.0, xmax + 1.0)
    } else {
        (xmin, xmax)
    };
    let ymax = pts().map(|p| p.1).fold(0.0, f64::max).max(1e-3) * 1.1;
    let step = tick_step(ymax, 6.0);
    let ymax = (ymax / step).ceil() * step;
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let x = |b: usize| LEFT + ((b as f64).log2() - xmin) / (xmax - xmin) * pw;
    let y = |g: f64| TOP + ph - g / ymax * ph;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        LEFT + pw / 2.0,
        esc(title)
    );
    // Axes, grid and ticks.
    let mut g = 0.0;
    while g <= ymax + step / 2.0 {
        let yy = y(g);
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            yy + 4.0,
            if step < 1.0 {
                format!("{g:.1}")
            } else {
                format!("{g:.0}")
            }
        );
        g += step;
    }
    let mut sizes: Vec<usize> = pts().map(|p| p.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for &b in &sizes {
        let xx = x(b);
        let _ = writeln!(
            o,
            r#"<line x1="{xx:.1}" y1="{:.1}" x2="{xx:.1}" y2="{:.1}" stroke="black"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + ph,
            TOP + ph + 5.0,
            TOP + ph + 20.0,
            (axis.label)(b)
        );
    }
    let _ = writeln!(
        o,
        r#"<polyline points="{LEFT},{TOP} {LEFT},{:.1} {:.1},{:.1}" fill="none" stroke="black"/>"#,
        TOP + ph,
        LEFT + pw,
        TOP + ph
    );
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        H - 15.0,
        axis.name
    );
    let _ = writeln!(
        o,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">GB/s</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    draw_series(&mut o, series, axis, &x, &y);
    o.push_str("</svg>\n");
    o
}

/// Each series' line and points, and its legend entry.
fn draw_series(
    o: &mut String,
    series: &[Series],
    axis: &XAxis,
    x: &dyn Fn(usize) -> f64,
    y: &dyn Fn(f64) -> f64,
) {
    for (i, s) in series.iter().enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        let dash = if s.reference {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let mut p = s.points.clone();
        p.sort_by_key(|q| q.0);
        let line: Vec<String> = p
            .iter()
            .map(|&(b, gb)| format!("{:.1},{:.1}", x(b), y(gb)))
            .collect();
        let _ = writeln!(
            o,
            r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"{dash}/>"#,
            line.join(" ")
        );
        for &(b, gb) in &p {
            let _ = writeln!(
                o,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"><title>{} {}: {gb:.3} GB/s</title></circle>"#,
                x(b),
                y(gb),
                esc(&s.name),
                (axis.label)(b)
            );
        }
        let ly = TOP + 10.0 + i as f64 * 20.0;
        let lx = W - RIGHT + 15.0;
        let _ = writeln!(
            o,
            r#"<line x1="{lx}" y1="{ly}" x2="{:.1}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 24.0,
            lx + 30.0,
            ly + 4.0,
            esc(&s.name)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_every_series_and_point() {
        let s = svg(
            "tcp <test>",
            &BLOCK_SIZE,
            &[
                Series {
                    name: "ferry write".into(),
                    points: vec![(4096, 1.5), (1 << 20, 3.0), (64 << 20, 3.2)],
                    reference: false,
                },
                Series {
                    name: "raw tcp".into(),
                    points: vec![(4096, 2.0), (1 << 20, 4.0), (64 << 20, 4.5)],
                    reference: true,
                },
            ],
        );
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(s.matches("<polyline").count(), 3, "axes + 2 series");
        assert_eq!(s.matches("<circle").count(), 6);
        assert!(s.contains("tcp &lt;test&gt;"));
        assert!(s.contains("stroke-dasharray"));
        assert!(s.contains(">64 MiB<"), "{s}");
        // One point alone still draws.
        let one = svg(
            "x",
            &XAxis {
                name: "streams",
                label: |n| n.to_string(),
            },
            &[Series {
                name: "a".into(),
                points: vec![(8, 0.0)],
                reference: false,
            }],
        );
        assert!(!one.contains("NaN"), "{one}");
        assert!(one.contains(">streams<") && one.contains(">8<"), "{one}");
    }
}
