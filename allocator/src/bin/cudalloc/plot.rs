//! `cudalloc replay --plot`: one self-contained HTML page (inline SVG, no scripts) with a panel
//! per trace: live bytes once, and allocated (dashed) and reserved (solid) bytes per
//! configuration, over the operation index.

use crate::replay_cmd::{Report, Run};
use crate::table::thousands;
use cudalloc::fmt::bytes;
use cudalloc::replay::Sample;
use std::fmt::Write;

const WIDTH: f64 = 1100.0;
const HEIGHT: f64 = 380.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 20.0;
const BOTTOM: f64 = 50.0;
const GIB: f64 = (1u64 << 30) as f64;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
];

/// The page.
pub fn html(reports: &[Report]) -> String {
    let mut s = String::from(concat!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
        "<title>cudalloc replay</title>\n<style>\n",
        "body { font-family: sans-serif; margin: 1.5em; color: #222; }\n",
        "h2 { font-size: 1.1em; margin: 1.5em 0 0.3em; }\n",
        "svg text { font-size: 12px; fill: #333; }\n",
        ".grid { stroke: #e4e4e4; } .axis { stroke: #555; }\n",
        "polyline { fill: none; stroke-width: 1.5; }\n",
        "</style>\n</head>\n<body>\n<h1>cudalloc replay: memory over each trace</h1>\n",
    ));
    for r in reports {
        let _ = writeln!(
            s,
            "<h2>{} <small>({} ops, peak live {})</small></h2>",
            escape(&r.name),
            thousands(r.ops),
            bytes(r.peak_live)
        );
        s += &panel(r);
    }
    s += "</body>\n</html>\n";
    s
}

/// The scales of one panel: data bounds and the plot area in pixels.
struct Scale {
    max_x: f64,
    max_y: f64,
}

impl Scale {
    fn x(&self, op: f64) -> f64 {
        LEFT + op / self.max_x * (WIDTH - LEFT - RIGHT)
    }

    fn y(&self, gib: f64) -> f64 {
        HEIGHT - BOTTOM - gib / self.max_y * (HEIGHT - TOP - BOTTOM)
    }
}

fn panel(r: &Report) -> String {
    let samples = r.runs.iter().flat_map(|run| &run.result.timeline);
    let max_x = samples.clone().map(|s| s.op).max().unwrap_or(0).max(1) as f64;
    let top = samples
        .map(|s| s.reserved.max(s.allocated).max(s.live))
        .max();
    let max_y = (top.unwrap_or(0) as f64 / GIB * 1.05).max(1e-3);
    let scale = Scale { max_x, max_y };
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
         viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\">\n"
    );
    s += &axes(&scale);
    let mut legend = vec![("live".to_string(), "#000", "")];
    for (i, run) in r.runs.iter().enumerate() {
        s += &series(&scale, run, COLORS[i % COLORS.len()], &mut legend);
    }
    // Live bytes are the same under every policy: drawn once, on top.
    if let Some(first) = r.runs.iter().find(|run| !run.result.timeline.is_empty()) {
        let points = line(&scale, &first.result.timeline, |p| p.live);
        s += &polyline(&points, "#000", "", "live (requested) bytes");
    }
    s += &legend_svg(&legend);
    s += "</svg>\n";
    s
}

fn series<'a>(
    scale: &Scale,
    run: &Run,
    color: &'a str,
    legend: &mut Vec<(String, &'a str, &'a str)>,
) -> String {
    let t = &run.result.timeline;
    let mut s = polyline(
        &line(scale, t, |p| p.allocated),
        color,
        "5,4",
        &format!("{}: allocated", run.label),
    );
    s += &polyline(
        &line(scale, t, |p| p.reserved),
        color,
        "",
        &format!("{}: reserved", run.label),
    );
    legend.push((format!("{} reserved", run.label), color, ""));
    legend.push((format!("{} allocated", run.label), color, "5,4"));
    s
}

fn line(scale: &Scale, timeline: &[Sample], value: impl Fn(&Sample) -> u64) -> String {
    let mut points = String::with_capacity(timeline.len() * 14);
    for p in timeline {
        let x = scale.x(p.op as f64);
        let y = scale.y(value(p) as f64 / GIB);
        let _ = write!(points, "{x:.1},{y:.1} ");
    }
    points
}

fn polyline(points: &str, color: &str, dash: &str, title: &str) -> String {
    let dash = if dash.is_empty() {
        String::new()
    } else {
        format!(" stroke-dasharray=\"{dash}\"")
    };
    format!(
        "<polyline stroke=\"{color}\"{dash} points=\"{}\"><title>{}</title></polyline>\n",
        points.trim_end(),
        escape(title)
    )
}

fn axes(scale: &Scale) -> String {
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let (y0, y1) = (HEIGHT - BOTTOM, TOP);
    let mut s = String::new();
    let step = nice_step(scale.max_y);
    let decimals = decimals(step);
    for i in 0..=((scale.max_y / step) as u64) {
        let v = i as f64 * step;
        let y = scale.y(v);
        let _ = writeln!(
            s,
            "<line class=\"grid\" x1=\"{x0}\" x2=\"{x1}\" y1=\"{y:.1}\" y2=\"{y:.1}\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.decimals$}</text>",
            x0 - 6.0,
            y + 4.0
        );
    }
    let step = nice_step(scale.max_x);
    for i in 0..=((scale.max_x / step) as u64) {
        let v = i as f64 * step;
        let x = scale.x(v);
        let _ = writeln!(
            s,
            "<line class=\"axis\" x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{y0}\" y2=\"{}\"/>\
             <text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            y0 + 5.0,
            y0 + 18.0,
            thousands(v as u64)
        );
    }
    let _ = write!(
        s,
        "<line class=\"axis\" x1=\"{x0}\" x2=\"{x1}\" y1=\"{y0}\" y2=\"{y0}\"/>\n\
         <line class=\"axis\" x1=\"{x0}\" x2=\"{x0}\" y1=\"{y0}\" y2=\"{y1}\"/>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">operation index</text>\n\
         <text transform=\"translate(18,{}) rotate(-90)\" text-anchor=\"middle\">GiB</text>\n",
        (x0 + x1) / 2.0,
        HEIGHT - 12.0,
        (y0 + y1) / 2.0
    );
    s
}

fn legend_svg(entries: &[(String, &str, &str)]) -> String {
    let x = WIDTH - RIGHT + 15.0;
    let mut s = String::new();
    for (i, (label, color, dash)) in entries.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * 18.0;
        let short: String = label.chars().take(30).collect();
        let _ = writeln!(
            s,
            "<line x1=\"{x}\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"{color}\" \
             stroke-width=\"2\" stroke-dasharray=\"{dash}\"/>\
             <text x=\"{}\" y=\"{}\"><title>{}</title>{}</text>",
            x + 24.0,
            x + 30.0,
            y + 4.0,
            escape(label),
            escape(&short)
        );
    }
    s
}

/// A round step (1, 2 or 5 times a power of ten) giving about five ticks up to `max`.
fn nice_step(max: f64) -> f64 {
    let raw = (max / 5.0).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    let nice = match raw / magnitude {
        f if f <= 1.0 => 1.0,
        f if f <= 2.0 => 2.0,
        f if f <= 5.0 => 5.0,
        _ => 10.0,
    };
    nice * magnitude
}

/// Decimals that show a tick step exactly.
fn decimals(step: f64) -> usize {
    if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    }
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{decimals, escape, nice_step};

    #[test]
    fn ticks_are_round() {
        assert_eq!(nice_step(10.0), 2.0);
        assert_eq!(nice_step(21.0), 5.0);
        assert!((nice_step(0.9) - 0.2).abs() < 1e-12);
        assert_eq!(decimals(2.0), 0);
        assert_eq!(decimals(0.5), 1);
        assert_eq!(decimals(0.05), 2);
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(escape("a<b>&\"c\""), "a&lt;b&gt;&amp;&quot;c&quot;");
    }
}
