//! The HTML timeline that `cudalloc replay --plot` writes, rendered by a real browser (headless
//! Chromium: Debian's `chromium` package), and what it drew, measured in the browser:
//! - one panel (an `svg`) per trace, one reserved and one allocated line per configuration and
//!   one live line, each with points, inside the plot area;
//! - every text (axes, legend) inside its panel, nothing cut off, the legend's names one below
//!   the other without overlapping, each in the colour of its configuration, all distinct;
//! - the lines say what the replay measured: the reserved line of each configuration lies on or
//!   above the live line, and `torch`'s reserved peak above `default`'s on `bert_dynamic`.
//!
//! Chromium is found as `$CUDALLOC_CHROMIUM`, else `chromium`, `chromium-browser` or
//! `google-chrome` on the path. The test is ignored by default (`cargo test` reports it so);
//! `.ci/run` installs Chromium and runs it with `--include-ignored`, and it fails when no
//! browser is found.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Measures, in the page, each panel and what it holds, into `<pre id="probe">` as JSON.
const PROBE: &str = r#"<script>
const out = [];
for (const svg of document.querySelectorAll('svg')) {
  const s = svg.getBoundingClientRect();
  const box = e => { const r = e.getBoundingClientRect();
    return { left: r.left - s.left, top: r.top - s.top, right: r.right - s.left, bottom: r.bottom - s.top }; };
  const own = t => [...t.childNodes].filter(n => n.nodeType === 3).map(n => n.textContent).join('');
  out.push({
    width: s.width, height: s.height,
    lines: [...svg.querySelectorAll('polyline')].map(p => ({
      stroke: p.getAttribute('stroke'), dash: p.getAttribute('stroke-dasharray') || '',
      title: p.querySelector('title').textContent, points: p.points.numberOfItems, ...box(p) })),
    texts: [...svg.querySelectorAll('text')].map(t => ({ text: own(t), ...box(t) })),
    legend: [...svg.querySelectorAll('line[stroke]')].map(l => l.getAttribute('stroke')),
  });
}
const pre = document.createElement('pre');
pre.id = 'probe';
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>
"#;

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CUDALLOC_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// The DOM Chromium holds once the page's script has run.
fn rendered_dom(browser: &Path, page: &Path) -> String {
    let o = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--window-size=1400,1000",
            "--dump-dom",
        ])
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("Chromium runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).expect("the DOM is UTF-8")
}

/// The probe's JSON out of the dumped DOM.
fn probe(dom: &str) -> Value {
    let start = dom.find("<pre id=\"probe\">").expect("the probe ran") + "<pre id=\"probe\">".len();
    let end = start + dom[start..].find("</pre>").expect("the probe's end");
    let text = dom[start..end]
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&amp;", "&");
    serde_json::from_str(&text).expect("the probe wrote JSON")
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"))
}

#[test]
#[ignore = "needs headless Chromium (apt-get install chromium)"]
fn the_plot_draws_every_line_and_name_inside_its_panel() {
    let browser =
        chromium().expect("no Chromium found: apt-get install chromium, or set CUDALLOC_CHROMIUM");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plot-browser");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let plot = dir.join("plot.html");
    let bert = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/bert_dynamic.trace.csv.gz");
    let long = "policy:default,fragmentation_budget:0.03,max_chunk_mb:64,layout_plans:false";
    let o = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(["replay", "--policy", "torch", "--policy", "default"])
        .args(["--config", long, "--plot"])
        .arg(&plot)
        .arg(&bert)
        .output()
        .expect("the cudalloc binary runs");
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let html = std::fs::read_to_string(&plot).unwrap();
    let page = dir.join("probe.html");
    std::fs::write(&page, html.replace("</body>", &format!("{PROBE}</body>"))).unwrap();

    let panels = probe(&rendered_dom(&browser, &page));
    let panels = panels.as_array().expect("a list of panels");
    assert_eq!(panels.len(), 1, "one panel per trace");
    let p = &panels[0];
    let (width, height) = (f(p, "width"), f(p, "height"));

    // Lines: 2 per configuration and the live line, with points, inside the panel.
    let lines = p["lines"].as_array().unwrap();
    assert_eq!(lines.len(), 2 * 3 + 1, "{lines:?}");
    for l in lines {
        assert!(l["points"].as_u64().unwrap() >= 2, "{l}");
        assert!(
            f(l, "right") > f(l, "left") && f(l, "bottom") > f(l, "top"),
            "{l}"
        );
        assert!(f(l, "left") >= -1.0 && f(l, "right") <= width + 1.0, "{l}");
        assert!(f(l, "top") >= -1.0 && f(l, "bottom") <= height + 1.0, "{l}");
    }

    // Texts: none cut off by the panel's edges.
    let texts = p["texts"].as_array().unwrap();
    for t in texts {
        assert!(
            f(t, "left") >= -0.5
                && f(t, "right") <= width + 0.5
                && f(t, "top") >= -0.5
                && f(t, "bottom") <= height + 0.5,
            "cut off: {t} in {width} x {height}"
        );
    }

    // The legend: three line styles, then one distinct name and colour per configuration,
    // one below the other.
    let legend_names = ["live (requested)", "reserved", "allocated"];
    let names: Vec<&Value> = texts
        .iter()
        .skip_while(|t| t["text"] != legend_names[0])
        .collect();
    assert_eq!(names.len(), 3 + 3, "{texts:?}");
    for w in names.windows(2) {
        assert!(
            f(w[0], "bottom") <= f(w[1], "top") + 0.5,
            "overlap: {} {}",
            w[0],
            w[1]
        );
    }
    let shown: Vec<&str> = names[3..]
        .iter()
        .map(|t| t["text"].as_str().unwrap())
        .collect();
    assert_eq!(&shown[..2], ["torch", "default"]);
    assert!(shown[2] != "torch" && shown[2] != "default", "{shown:?}");
    let colors: Vec<&str> = p["legend"].as_array().unwrap()[3..]
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(colors.len(), 3);
    assert!(colors[0] != colors[1] && colors[1] != colors[2] && colors[0] != colors[2]);

    // What the lines say: higher on the page is more bytes (a smaller `top`).
    let top_of = |title: &str| {
        let l = lines.iter().find(|l| l["title"] == title);
        f(l.unwrap_or_else(|| panic!("no line `{title}`")), "top")
    };
    let live = top_of("live (requested) bytes");
    for label in ["torch", "default", long] {
        let reserved = top_of(&format!("{label}: reserved"));
        assert!(
            reserved <= live + 1.0,
            "{label}: reserved {reserved} below live {live}"
        );
        let stroke = |kind: &str| {
            lines
                .iter()
                .find(|l| l["title"] == format!("{label}: {kind}"))
                .unwrap()["stroke"]
                .clone()
        };
        assert_eq!(
            stroke("reserved"),
            stroke("allocated"),
            "{label}: one colour"
        );
    }
    assert!(
        top_of("torch: reserved") + 20.0 < top_of("default: reserved"),
        "torch reserves about twice the live bytes on bert_dynamic, default about 1.04 x"
    );
}
