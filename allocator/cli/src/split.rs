//! A split trace set (`traces/split.json`: the traces a policy was tuned on, and those held
//! out), read for `cudalloc replay --split FILE.json` (the summary once more for each part, so
//! that a configuration that only fits the traces it was tuned on shows) and for
//! `examples/rule_table.rs`.
//!
//! The file is a JSON object; each key whose value is an array is a part, named by the key, and
//! every other key (a description) is ignored: a key whose value is a string is no part, even if
//! it names a trace. An entry names a trace by its path or file name, and may say more after a
//! space (`"llama_generate (shared set)"`): a trace belongs to the part whose entry has its
//! *stem*, the file name up to its first dot (`traces/h200/kv_serve.trace.csv.gz` and
//! `kv_serve.trace.csv` are both `kv_serve`; of an entry the first word counts, of a trace's
//! name, which may be a path with spaces, all of it).
//!
//! Invariants: the parts are sorted by name, each has at least one entry, and no stem is in two
//! parts, nor twice in one. A key given twice in the object with an array as either value is
//! refused (a JSON reader keeps one of the two, so a part would silently lose its traces); a
//! description key (any other value) may repeat.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use std::path::Path;

/// The parts of a split trace set, in the order of their names.
#[derive(Debug, PartialEq)]
pub struct Split {
    parts: Vec<(String, Vec<String>)>,
}

impl Split {
    /// Reads a split file; an error names the file and what is wrong in it.
    pub fn read(path: &Path) -> Result<Split, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the split file {}: {e}", path.display()))?;
        Split::parse(&text).map_err(|e| format!("split file {}: {e}", path.display()))
    }

    /// Parses a split file's text (see the module docs).
    pub fn parse(text: &str) -> Result<Split, String> {
        let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let Value::Object(map) = value else {
            return Err("not a JSON object of parts (key: array of trace names)".into());
        };
        if let Some(key) = key_given_twice(text)? {
            return Err(format!("key `{key}` is given twice"));
        }
        let mut parts: Vec<(String, Vec<String>)> = Vec::new();
        for (key, v) in &map {
            let Value::Array(entries) = v else { continue };
            if entries.is_empty() {
                return Err(format!("part `{key}` names no trace"));
            }
            let mut stems = Vec::with_capacity(entries.len());
            for (i, e) in entries.iter().enumerate() {
                let stem = e.as_str().map(entry_stem).filter(|s| !s.is_empty());
                let stem = stem.ok_or_else(|| {
                    format!(
                        "part `{key}`, entry {}: not the name of a trace: {e}",
                        i + 1
                    )
                })?;
                if let Some((other, _)) = parts.iter().find(|(_, s)| s.contains(&stem)) {
                    return Err(format!("trace `{stem}` is in both `{other}` and `{key}`"));
                }
                if stems.contains(&stem) {
                    return Err(format!(
                        "part `{key}`, entry {}: trace `{stem}` is listed twice",
                        i + 1
                    ));
                }
                stems.push(stem);
            }
            parts.push((key.clone(), stems));
        }
        if parts.is_empty() {
            return Err("no part (a key whose value is an array of trace names)".into());
        }
        parts.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Split { parts })
    }

    /// The name of the part trace `name` (a report's name or a path) belongs to.
    pub fn part_of(&self, name: &str) -> Option<&str> {
        let s = stem(name);
        self.parts
            .iter()
            .find(|(_, stems)| stems.contains(&s))
            .map(|(part, _)| part.as_str())
    }

    /// The parts' names, in order.
    pub fn parts(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().map(|(name, _)| name.as_str())
    }
}

/// The first key of the top-level JSON object `text` given twice with an array (a part) as one
/// of its values, if any; a description key may repeat.
fn key_given_twice(text: &str) -> Result<Option<String>, String> {
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut seen = std::collections::HashMap::new();
            let mut twice = None;
            // The whole object is read: the reader refuses one left unfinished.
            while let Some(key) = map.next_key::<String>()? {
                let part = map.next_value::<Value>()?.is_array();
                match seen.insert(key.clone(), part) {
                    Some(before) if before || part => twice = twice.or(Some(key)),
                    _ => {}
                }
            }
            Ok(twice)
        }
    }
    struct Twice(Option<String>);
    impl<'de> Deserialize<'de> for Twice {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_map(Keys).map(Twice)
        }
    }
    serde_json::from_str::<Twice>(text)
        .map(|t| t.0)
        .map_err(|e| format!("not JSON: {e}"))
}

/// The stem of a split file's entry: that of its first word (what follows a space is a note).
fn entry_stem(entry: &str) -> String {
    stem(entry.split_whitespace().next().unwrap_or(""))
}

/// The stem of a trace's name or path: its file name up to the first dot.
fn stem(name: &str) -> String {
    let file = name.rsplit(['/', '\\']).next().unwrap_or("");
    file.split('.').next().unwrap_or("").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_read_by_name_and_traces_found_by_stem() {
        let s = Split::parse(
            r#"{"about": "text", "tuning": ["traces/a.trace.csv.gz", "b (not bundled)"],
                "held_out": ["traces/h200/c.trace.csv.gz"]}"#,
        )
        .unwrap();
        assert_eq!(s.part_of("a.trace.csv"), Some("tuning"));
        assert_eq!(s.part_of("b.trace.csv"), Some("tuning"));
        assert_eq!(s.part_of("/tmp/c.trace.csv.gz"), Some("held_out"));
        assert_eq!(s.part_of("d.trace.csv"), None);
        assert_eq!(s.parts[0].0, "held_out");
        // Names made paths (two traces of one file name), spaces and backslashes included.
        assert_eq!(
            s.part_of("/home/u/My Traces/a.trace.csv.gz"),
            Some("tuning")
        );
        assert_eq!(
            s.part_of(r"C:\Users\Jane Doe\c.trace.csv"),
            Some("held_out")
        );
        assert_eq!(s.part_of("b"), Some("tuning"));
    }

    #[test]
    fn a_bad_split_is_refused_with_what_is_wrong() {
        let err = |t: &str| Split::parse(t).unwrap_err();
        assert!(err("[1]").contains("not a JSON object"), "{}", err("[1]"));
        assert!(err("{").contains("not JSON"));
        assert!(err(r#"{"about": "x"}"#).contains("no part"));
        assert!(err(r#"{"t": []}"#).contains("part `t` names no trace"));
        let e = err(r#"{"t": ["a.csv", 3]}"#);
        assert!(e.contains("part `t`, entry 2"), "{e}");
        let e = err(r#"{"t": ["x/a.trace.csv.gz"], "h": ["a.csv"]}"#);
        assert!(e.contains("trace `a` is in both"), "{e}");
        let e = err(r#"{"t": ["x/a.trace.csv.gz", "b.csv", "a (again)"]}"#);
        assert!(
            e.contains("part `t`, entry 3: trace `a` is listed twice"),
            "{e}"
        );
        // A JSON reader keeps one value of a key given twice: part `t` would lose `a`.
        let e = err(r#"{"about": "x", "t": ["a.csv"], "h": ["b.csv"], "t": ["c.csv"]}"#);
        assert!(e.contains("key `t` is given twice"), "{e}");
        // A description may repeat; a part may not, even beside a description of its name.
        assert!(Split::parse(r#"{"about": "x", "about": "y", "t": ["a.csv"]}"#).is_ok());
        let e = err(r#"{"about": "x", "t": "a note", "t": ["a.csv"]}"#);
        assert!(e.contains("key `t` is given twice"), "{e}");
    }

    #[test]
    fn the_bundled_split_names_every_bundled_trace() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let split = Split::read(&root.join("traces/split.json")).unwrap();
        let mut bundled = Vec::new();
        for dir in ["traces", "traces/h200"] {
            for e in std::fs::read_dir(root.join(dir)).unwrap() {
                let name = e.unwrap().file_name().into_string().unwrap();
                if name.ends_with(".gz") {
                    bundled.push(name);
                }
            }
        }
        assert!(bundled.len() >= 40, "{}", bundled.len());
        for name in &bundled {
            assert!(split.part_of(name).is_some(), "{name} is in no part");
        }
        assert_eq!(split.part_of("gpt2_train.trace.csv"), Some("tuning"));
        assert_eq!(
            split.part_of("gpt2_train_varlen.trace.csv"),
            Some("held_out")
        );
    }
}
