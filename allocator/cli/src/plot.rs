//! `cudalloc replay --plot`: one self-contained HTML page (inline SVG, no scripts) with a panel
//! per trace: live bytes once, and allocated (dashed) and reserved (solid) bytes per
//! configuration, over the operation index. The legend gives each configuration one colour and
//! a name: its label, shortened when long (see [`legend_names`]) and always told apart from the
//! others'; the whole label is the name's tooltip.

use crate::args::entries;
use crate::report::{Report, Run};
use crate::table::thousands;
use cudalloc::fmt::bytes;
use cudalloc_trace::replay::Sample;
use std::fmt::Write;

const WIDTH: f64 = 1100.0;
const HEIGHT: f64 = 380.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 20.0;
const BOTTOM: f64 = 50.0;
const GIB: f64 = (1u64 << 30) as f64;
/// Characters of a legend name beyond which a label is shortened (a label of the `default`
/// policy and one swept key, such as `policy:default,fragmentation_budget:0.01`, fits).
const LEGEND_CHARS: usize = 40;
/// Characters of a label's start that an elided name keeps at least.
const MIN_HEAD: usize = 6;
/// Pixels a legend character takes at most, about (12 px sans-serif).
const CHAR_WIDTH: f64 = 7.0;
/// Pixels between two rows of the legend.
const ROW: f64 = 18.0;
/// Pixels from the legend's left edge to its text.
const LEGEND_TEXT: f64 = 45.0;
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
    let legend = legend(&r.runs);
    let (width, height) = svg_size(&legend);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" role=\"img\">\n"
    );
    s += &axes(&scale);
    for (i, run) in r.runs.iter().enumerate() {
        s += &series(&scale, run, COLORS[i % COLORS.len()]);
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

/// The legend: what the line styles mean, then one colour and name per configuration.
fn legend(runs: &[Run]) -> Vec<Entry> {
    let mut legend = vec![
        Entry::plain("live (requested)", "#000", ""),
        Entry::plain("reserved", "#888", ""),
        Entry::plain("allocated", "#888", "5,4"),
    ];
    let labels: Vec<&str> = runs.iter().map(|run| run.label.as_str()).collect();
    for (i, (run, name)) in runs.iter().zip(legend_names(&labels)).enumerate() {
        legend.push(Entry {
            name,
            title: run.label.clone(),
            color: COLORS[i % COLORS.len()],
            dash: "",
        });
    }
    legend
}

/// A panel's width and height in pixels: wider and taller than the plot when the legend needs
/// it, so that no name is cut off.
fn svg_size(legend: &[Entry]) -> (f64, f64) {
    let chars = legend.iter().map(|e| e.name.chars().count()).max();
    let legend_width = LEGEND_TEXT + chars.unwrap_or(0) as f64 * CHAR_WIDTH + 10.0;
    let legend_height = TOP + 10.0 + legend.len() as f64 * ROW;
    (
        WIDTH.max(WIDTH - RIGHT + legend_width).ceil(),
        HEIGHT.max(legend_height),
    )
}

fn series(scale: &Scale, run: &Run, color: &str) -> String {
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

/// One row of the legend: a line sample and a name (with its tooltip).
struct Entry {
    name: String,
    title: String,
    color: &'static str,
    dash: &'static str,
}

impl Entry {
    fn plain(name: &str, color: &'static str, dash: &'static str) -> Entry {
        Entry {
            name: name.to_string(),
            title: name.to_string(),
            color,
            dash,
        }
    }
}

/// The legend's name for each label: the label when it fits in [`LEGEND_CHARS`]; else, when
/// several labels are too long, without the config entries that begin all of those (a sweep's
/// base), then with its middle elided if still too long. A name that would read like another
/// label or name is the whole label instead, so the names are as distinct as the labels.
fn legend_names(labels: &[&str]) -> Vec<String> {
    let long = |l: &&str| l.chars().count() > LEGEND_CHARS;
    let too_long: Vec<&str> = labels.iter().copied().filter(long).collect();
    let prefix = if too_long.len() > 1 {
        shared_entries(&too_long)
    } else {
        0
    };
    let names: Vec<String> = labels
        .iter()
        .map(|l| match l {
            l if !long(l) => l.to_string(),
            l if prefix > 0 => elide_middle(&format!("…{}", &l[prefix..])),
            l => elide_middle(l),
        })
        .collect();
    let clashes = |n: &String, l: &str| {
        names.iter().filter(|m| *m == n).count() > 1 || (n != l && labels.contains(&n.as_str()))
    };
    names
        .iter()
        .zip(labels)
        .map(|(n, l)| {
            if clashes(n, l) {
                l.to_string()
            } else {
                n.clone()
            }
        })
        .collect()
}

/// Bytes of the leading config entries (with their commas) that every label begins with, each
/// label keeping at least one entry after them.
fn shared_entries(labels: &[&str]) -> usize {
    let split: Vec<Vec<&str>> = labels.iter().map(|l| entries(l)).collect();
    let first = &split[0];
    let n = (0..first.len())
        .take_while(|&i| split.iter().all(|e| e.len() > i + 1 && e[i] == first[i]))
        .count();
    first[..n].iter().map(|e| e.len() + 1).sum()
}

/// `s` cut to [`LEGEND_CHARS`] characters by eliding its middle: a few characters of its start
/// (none when it begins with `…` already) and, longer, its end, with the whole of its last
/// entry (where a swept value stands) when it fits beside them.
fn elide_middle(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    if chars.len() <= LEGEND_CHARS {
        return s.to_string();
    }
    let last = entries(s).last().map_or(0, |e| e.chars().count());
    let tail = if chars[0] == '…' {
        // Its start was dropped already (shared by the other long labels): the end alone.
        LEGEND_CHARS - 1
    } else {
        last.clamp(LEGEND_CHARS * 2 / 3, LEGEND_CHARS - 1 - MIN_HEAD)
    };
    let mut out: String = chars[..LEGEND_CHARS - 1 - tail].iter().collect();
    out.push('…');
    out.extend(&chars[chars.len() - tail..]);
    out
}

fn legend_svg(entries: &[Entry]) -> String {
    let x = WIDTH - RIGHT + 15.0;
    let mut s = String::new();
    for (i, e) in entries.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * ROW;
        let _ = writeln!(
            s,
            "<line x1=\"{x}\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"{}\" \
             stroke-width=\"2\" stroke-dasharray=\"{}\"/>\
             <text x=\"{}\" y=\"{}\"><title>{}</title>{}</text>",
            x + 24.0,
            e.color,
            e.dash,
            x + LEGEND_TEXT - 15.0,
            y + 4.0,
            escape(&e.title),
            escape(&e.name)
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
    use super::{decimals, elide_middle, escape, legend_names, nice_step, LEGEND_CHARS};

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

    /// Long labels lose the entries they all begin with, then their middle; the names stay
    /// distinct, and a name that would read like another label is the whole label.
    #[test]
    fn legend_names_are_short_and_distinct() {
        let base = "policy:torch,max_split_size_mb:128,roundup_power2_divisions:[256:1,>:2]";
        let a = format!("{base},garbage_collection_threshold:0.5");
        let b = format!("{base},garbage_collection_threshold:0.8");
        let c = "policy:torch,max_split_size_mb:128";
        let names = legend_names(&["torch", &a, &b, c]);
        assert_eq!(
            names,
            [
                "torch",
                "…garbage_collection_threshold:0.5",
                "…garbage_collection_threshold:0.8",
                c,
            ]
        );
        // One long label: its middle elided, its end (where a swept value stands) kept.
        let names = legend_names(&["torch", &a]);
        assert_eq!(names[1].chars().count(), LEGEND_CHARS);
        assert!(
            names[1].ends_with("garbage_collection_threshold:0.5"),
            "{names:?}"
        );
        // Labels that differ only in the middle: the whole labels.
        let x = format!("policy:torch,max_split_size_mb:128,{}", "x".repeat(40));
        let y = format!("policy:torch,max_split_size_mb:256,{}", "x".repeat(40));
        assert_eq!(legend_names(&[&x, &y]), [x.clone(), y.clone()]);
        assert_eq!(elide_middle("short"), "short");
    }
}
