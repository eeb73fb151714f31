//! A pre-scan of a pickle's opcodes that bounds how deeply its decoded values can nest, so that
//! a hostile or corrupt file is an error rather than a stack overflow in the decoder.
//!
//! `serde-pickle` builds, clones, converts and drops values recursively, one stack frame (or a
//! few) per level of nesting; a pickle of a few bytes per level (`TUPLE1` repeated, marks, memo
//! references) can nest a million levels deep. The scan runs the pickle machine as
//! `serde-pickle` 1.2 does, opcode by opcode, without building any value:
//! - every container an opcode makes (`EMPTY_*`, `TUPLE1..3`, `TUPLE`, `LIST`, `DICT`,
//!   `FROZENSET`, `REDUCE`, `INST`, `OBJ`, `NEWOBJ(_EX)`, and the copy `DUP` makes) is a node,
//!   with an edge to each value it holds; `APPEND(S)`, `SETITEM(S)` and `ADDITEMS` add edges from
//!   the container they fill; `BUILD` keeps its state;
//! - every memo id is a node too, with an edge to each value ever put under it; a memo get
//!   pushes that node, so a container holding a memo reference reaches whatever the reference
//!   resolves to, and a container filled through a memo reference gets its edges on that node.
//!
//! Invariant: a decoded value nests no deeper than the longest path from its node, counting
//! nodes, where a cycle (a recursive structure, or a copy filled with itself) counts all the
//! nodes of its strongly connected set. The check covers everything built before the decoder
//! would stop (an unknown opcode, a stack underflow, `STOP`), since values built so far are
//! dropped recursively too. A pickle is refused when that bound, or the number of marks open at
//! once (each costs the decoder a buffer), passes [`MAX_DEPTH`]. PyTorch snapshots stay below
//! 20. `DUP` of a container is refused outright: the decoder copies the value whole, so a few
//! bytes of `DUP` + `APPEND` double the decoded size each time (84 bytes made an allocation of
//! 2^40 values fail); Python's pickler never writes `DUP`. The decoder copies a memo's value
//! for each reference to it too, when it turns the pickle into values: a pickle is refused
//! when the graph unfolded (every node as many times as paths reach it) passes
//! [`MAX_VALUES_PER_BYTE`] values per byte of the file (a list of 100,000 references to a list
//! of 100,000 values is a 300 KB file of 10^10 values; PyTorch snapshots share their stack
//! frames this way, far below the bound).

use std::collections::HashMap;

/// Nesting (and open marks) above which a pickle is refused.
pub const MAX_DEPTH: usize = 1_000;

/// Checks that no value of the pickle nests deeper than [`MAX_DEPTH`] levels.
pub fn check_nesting(b: &[u8]) -> Result<(), String> {
    if u32::try_from(b.len()).is_err() {
        return Err("a pickle of 4 GiB or more is not read; convert it to CSV".to_string());
    }
    let mut m = Machine::default();
    let mut i = 0;
    while i < b.len() {
        let op = b[i];
        let end = skip_argument(op, b, i + 1);
        let more = m.step(op, &b[i + 1..end]);
        i = end;
        if m.marks.len() > MAX_DEPTH {
            return Err(too_deep());
        }
        if m.copied_container {
            return Err(
                "the pickle copies a container with DUP, which is not read: the decoder \
                        copies it whole, so each DUP can double the decoded size (Python's \
                        pickler never writes DUP)"
                    .to_string(),
            );
        }
        if more.is_none() {
            break;
        }
    }
    // The decoder copies a memo's value for each reference to it, so what it builds is the
    // graph unfolded into a tree.
    let max_values = MAX_VALUES_PER_BYTE
        .saturating_mul(b.len() as u64)
        .max(MIN_MAX_VALUES);
    let g = Graph::new(m.nodes as usize, &m.edges);
    match g.exceeds(&m.weight, MAX_DEPTH, max_values) {
        None => Ok(()),
        Some(Excess::Depth) => Err(too_deep()),
        Some(Excess::Values) => Err(format!(
            "the pickle would decode to more than {max_values} values (the bound is \
             {MAX_VALUES_PER_BYTE} per byte of the file, at least {MIN_MAX_VALUES}): its memo \
             references repeat large values many times over"
        )),
    }
}

/// Values a pickle may decode to, per byte of the file (or [`MIN_MAX_VALUES`] for a small
/// file): a memo reference is a few bytes and the decoder copies the value it names, so a
/// small file can name a great many values (a list of 100,000 references to a list of 100,000
/// values: 300 KB for 10^10 values).
pub const MAX_VALUES_PER_BYTE: u64 = 64;

/// Values any pickle may decode to, however small the file.
pub const MIN_MAX_VALUES: u64 = 1 << 20;

/// Why [`Graph::exceeds`] refused.
#[derive(Debug, PartialEq, Eq)]
enum Excess {
    Depth,
    Values,
}

fn too_deep() -> String {
    format!("values are nested more than {MAX_DEPTH} levels deep")
}

/// A value on the machine's stack: a container's node, or `None` for a scalar.
type Item = Option<u32>;

/// The pickle machine with nodes for values (see the module documentation).
#[derive(Default)]
struct Machine {
    stack: Vec<Item>,
    /// Stack length at each open mark.
    marks: Vec<usize>,
    memo: Memo,
    nodes: u32,
    edges: Vec<(u32, u32)>,
    /// Values each node stands for itself (a container 1, plus the scalars it holds; a memo
    /// id the scalars put under it), besides those of the nodes it reaches.
    weight: Vec<u64>,
    /// `DUP` copied a container.
    copied_container: bool,
}

impl Machine {
    /// Runs one opcode; `None` where the decoder stops (`STOP`, an error, an unknown opcode).
    fn step(&mut self, op: u8, arg: &[u8]) -> Option<()> {
        match op {
            0x80 | 0x95 => {}
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                if self.pop().is_none() {
                    let at = self.marks.pop()?;
                    self.stack.truncate(at);
                }
            }
            b'1' => {
                let at = self.marks.pop()?;
                self.stack.truncate(at);
            }
            b'2' => {
                // DUP copies the top: a node that reaches the original (as deep, or deeper once
                // the original is filled further). A container copied is noted: refused.
                let at = self.above(1)?;
                self.copied_container |= self.stack[at].is_some();
                let copy = self.stack[at].map(|t| self.node(1, &[Some(t)]));
                self.stack.push(copy);
            }
            b'p' | b'q' | b'r' | 0x94 => self.put(op, arg)?,
            b'g' | b'h' | b'j' => {
                let node = self.memo.get(memo_id(op, arg)?)?;
                self.stack.push(Some(node));
            }
            b'N' | 0x88 | 0x89 | b'I' | b'L' | b'F' | b'S' | b'V' | b'G' | b'J' | b'K' | b'M'
            | 0x8a | 0x8b | b'C' | b'B' | 0x8e | b'U' | b'T' | 0x8c | b'X' | 0x8d | 0x96 | b'c' => {
                self.stack.push(None)
            }
            _ => self.build(op)?,
        }
        Some(())
    }

    /// Opcodes that make or fill containers.
    fn build(&mut self, op: u8) -> Option<()> {
        match op {
            b')' | b']' | b'}' | 0x8f => self.make(self.stack.len()),
            0x85..=0x87 => self.make(self.above(usize::from(op - 0x84))?),
            b't' | b'l' | b'd' | 0x91 | b'i' => {
                let at = self.marks.pop()?;
                self.make(at);
            }
            b'o' => {
                let at = self.marks.pop()?;
                let class = at.checked_sub(1).filter(|&c| c >= self.base())?;
                self.make(class);
            }
            b'R' | 0x81 => self.make(self.above(2)?),
            0x92 => self.make(self.above(3)?),
            b'a' => self.fill(self.above(1)?)?,
            b's' => self.fill(self.above(2)?)?,
            b'e' | b'u' | 0x90 => {
                let at = self.marks.pop()?;
                self.fill(at)?;
            }
            b'b' => {
                let at = self.above(2)?;
                self.stack[at] = self.stack[at + 1];
                self.stack.truncate(at + 1);
            }
            0x93 => {
                let at = self.above(2)?;
                self.stack.truncate(at);
                self.stack.push(None);
            }
            _ => return None,
        }
        Some(())
    }

    /// A new node of `weight` values holding `items`.
    fn node(&mut self, weight: u64, items: &[Item]) -> u32 {
        let node = self.nodes;
        self.nodes += 1;
        self.weight.push(weight);
        self.edges
            .extend(items.iter().flatten().map(|&c| (node, c)));
        node
    }

    /// Replaces the items from `at` up with a new container holding them.
    fn make(&mut self, at: usize) {
        let node = self.node(1, &[]);
        self.add_items(node, at);
        self.stack.push(Some(node));
    }

    /// Moves the items from `at` up into the container below them.
    fn fill(&mut self, at: usize) -> Option<()> {
        let below = at.checked_sub(1).filter(|&b| b >= self.base())?;
        let container = self.stack[below]?;
        self.add_items(container, at);
        Some(())
    }

    /// Moves the items from `at` up into `node`: an edge to each container, a value of its
    /// weight for each scalar.
    fn add_items(&mut self, node: u32, at: usize) {
        let mut scalars = 0;
        for item in self.stack.drain(at..) {
            match item {
                Some(c) => self.edges.push((node, c)),
                None => scalars += 1,
            }
        }
        self.weight[node as usize] += scalars;
    }

    /// `PUT`, `BINPUT`, `LONG_BINPUT`, `MEMOIZE`: the top moves under the memo id's node.
    fn put(&mut self, op: u8, arg: &[u8]) -> Option<()> {
        let id = match op {
            0x94 => u32::try_from(self.memo.len()).ok()?,
            _ => memo_id(op, arg)?,
        };
        let item = self.pop()?;
        let node = match self.memo.get(id) {
            Some(n) => n,
            None => {
                let n = self.node(0, &[]);
                self.memo.insert(id, n);
                n
            }
        };
        match item {
            Some(c) => self.edges.push((node, c)),
            None => self.weight[node as usize] += 1,
        }
        self.stack.push(Some(node));
        Some(())
    }

    /// Stack length at the innermost open mark: the decoder pops no further.
    fn base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    /// Where the top `n` items start, if that many are above the innermost mark.
    fn above(&self, n: usize) -> Option<usize> {
        let at = self.stack.len().checked_sub(n)?;
        (at >= self.base()).then_some(at)
    }

    fn pop(&mut self) -> Option<Item> {
        let at = self.above(1)?;
        let top = self.stack[at];
        self.stack.truncate(at);
        Some(top)
    }
}

/// Memo id -> node: ids given in order (as picklers do) in a vector, any others in a map.
#[derive(Default)]
struct Memo {
    dense: Vec<u32>,
    sparse: HashMap<u32, u32>,
}

impl Memo {
    fn get(&self, id: u32) -> Option<u32> {
        match self.dense.get(id as usize) {
            Some(&n) => Some(n),
            None => self.sparse.get(&id).copied(),
        }
    }

    /// Adds an id that is not there yet.
    fn insert(&mut self, id: u32, node: u32) {
        if id as usize == self.dense.len() && !self.sparse.contains_key(&id) {
            self.dense.push(node);
        } else {
            self.sparse.insert(id, node);
        }
    }

    fn len(&self) -> usize {
        self.dense.len() + self.sparse.len()
    }
}

/// The memo id of a put or get opcode (text for protocol 0, little-endian binary after).
fn memo_id(op: u8, arg: &[u8]) -> Option<u32> {
    match op {
        b'q' | b'h' => arg.first().map(|&b| u32::from(b)),
        b'r' | b'j' => Some(u32::from_le_bytes(arg.try_into().ok()?)),
        _ => {
            let line = arg.strip_suffix(b"\n").unwrap_or(arg);
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            std::str::from_utf8(line).ok()?.parse().ok()
        }
    }
}

/// The nodes and edges, by source node.
struct Graph {
    /// Node `v`'s edges are `to[start[v]..start[v + 1]]`.
    start: Vec<usize>,
    to: Vec<u32>,
}

const UNSEEN: u32 = u32::MAX;

impl Graph {
    fn new(nodes: usize, edges: &[(u32, u32)]) -> Graph {
        let mut start = vec![0usize; nodes + 1];
        for &(from, _) in edges {
            start[from as usize + 1] += 1;
        }
        for v in 0..nodes {
            start[v + 1] += start[v];
        }
        let mut next = start.clone();
        let mut to = vec![0u32; edges.len()];
        for &(from, target) in edges {
            to[next[from as usize]] = target;
            next[from as usize] += 1;
        }
        Graph { start, to }
    }

    fn targets(&self, v: u32) -> &[u32] {
        &self.to[self.start[v as usize]..self.start[v as usize + 1]]
    }

    fn nodes(&self) -> usize {
        self.start.len() - 1
    }

    /// Whether some path, counting nodes (a strongly connected set as all its nodes), is longer
    /// than `depth`, or the values some node unfolds to (its weight and, for each edge, those
    /// of the node it reaches; a strongly connected set counted once) pass `values`. Tarjan's
    /// algorithm without recursion: a set is finished only after every set it reaches, so the
    /// depth and values of those are known when it is.
    fn exceeds(&self, weight: &[u64], depth: usize, values: u64) -> Option<Excess> {
        let mut t = Tarjan::new(self.nodes());
        (0..self.nodes() as u32).find_map(|v| match t.index[v as usize] {
            UNSEEN => t.run(self, weight, v, (depth, values)),
            _ => None,
        })
    }
}

/// Tarjan's strongly connected sets, with the longest path from each set.
struct Tarjan {
    index: Vec<u32>,
    low: Vec<u32>,
    /// The set of each finished node, `UNSEEN` before.
    set: Vec<u32>,
    /// Longest path from each finished set.
    depth: Vec<usize>,
    /// Values each finished set unfolds to.
    values: Vec<u64>,
    open: Vec<u32>,
    next_index: u32,
}

impl Tarjan {
    fn new(nodes: usize) -> Tarjan {
        Tarjan {
            index: vec![UNSEEN; nodes],
            low: vec![0; nodes],
            set: vec![UNSEEN; nodes],
            depth: Vec::new(),
            values: Vec::new(),
            open: Vec::new(),
            next_index: 0,
        }
    }

    fn visit(&mut self, v: u32) {
        self.index[v as usize] = self.next_index;
        self.low[v as usize] = self.next_index;
        self.next_index += 1;
        self.open.push(v);
    }

    /// Visits everything reachable from `root`; stops at the first set deeper or larger than
    /// `limit` (depth, values).
    fn run(&mut self, g: &Graph, weight: &[u64], root: u32, limit: (usize, u64)) -> Option<Excess> {
        let mut calls: Vec<(u32, usize)> = vec![(root, 0)];
        self.visit(root);
        while let Some(call) = calls.last_mut() {
            let (v, at) = *call;
            call.1 += 1;
            if let Some(&w) = g.targets(v).get(at) {
                if self.index[w as usize] == UNSEEN {
                    self.visit(w);
                    calls.push((w, 0));
                } else if self.set[w as usize] == UNSEEN {
                    self.low[v as usize] = self.low[v as usize].min(self.index[w as usize]);
                }
                continue;
            }
            calls.pop();
            if let Some(&(parent, _)) = calls.last() {
                self.low[parent as usize] = self.low[parent as usize].min(self.low[v as usize]);
            }
            if self.low[v as usize] == self.index[v as usize] {
                let (depth, values) = self.finish(g, weight, v);
                if depth > limit.0 {
                    return Some(Excess::Depth);
                }
                if values > limit.1 {
                    return Some(Excess::Values);
                }
            }
        }
        None
    }

    /// Closes the set whose root is `v`; returns its depth and the values it unfolds to.
    fn finish(&mut self, g: &Graph, weight: &[u64], v: u32) -> (usize, u64) {
        let set = self.depth.len() as u32;
        let at = self.open.iter().rposition(|&x| x == v).unwrap_or(0);
        let members = self.open.split_off(at);
        for &m in &members {
            self.set[m as usize] = set;
        }
        let (mut below, mut values) = (0, 0u64);
        for &m in &members {
            values = values.saturating_add(weight[m as usize]);
            for &w in g.targets(m) {
                let s = self.set[w as usize];
                if s != set {
                    below = below.max(self.depth[s as usize]);
                    values = values.saturating_add(self.values[s as usize]);
                }
            }
        }
        let depth = members.len() + below;
        self.depth.push(depth);
        self.values.push(values);
        (depth, values)
    }
}

/// Index after the opcode's argument (clamped to the end of the input).
fn skip_argument(op: u8, b: &[u8], i: usize) -> usize {
    let fixed = |n: usize| (i + n).min(b.len());
    let prefixed = |n: usize| {
        let Some(len) = b.get(i..i + n) else {
            return b.len();
        };
        let mut v = 0usize;
        for (k, &x) in len.iter().enumerate() {
            v |= (x as usize) << (8 * k);
        }
        i.saturating_add(n).saturating_add(v).min(b.len())
    };
    let lines = |n: usize| {
        let mut j = i;
        for _ in 0..n {
            j = b[j.min(b.len())..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |p| j + p + 1);
        }
        j
    };
    match op {
        b'K' | b'h' | b'q' | 0x82 | 0x80 => fixed(1),
        b'M' | 0x83 => fixed(2),
        b'J' | b'j' | b'r' | 0x84 => fixed(4),
        b'G' | 0x95 => fixed(8),
        b'U' | b'C' | 0x8c | 0x8a => prefixed(1),
        b'T' | b'B' | b'X' | 0x8b => prefixed(4),
        0x8d | 0x8e | 0x96 => prefixed(8),
        b'I' | b'L' | b'F' | b'S' | b'V' | b'g' | b'p' | b'P' => lines(1),
        b'c' | b'i' => lines(2),
        _ => i,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pickle(body: &[u8]) -> Vec<u8> {
        [&b"\x80\x04"[..], body, b"."].concat()
    }

    fn refused(p: &[u8]) -> bool {
        check_nesting(p).is_err_and(|m| m.contains("nested more than 1000 levels"))
    }

    /// `levels` values, each made by `before`, a memo get of the one before (id k - 1, with
    /// `get`), `after`, then put under id k (with `put`; `MEMOIZE` takes the next id) and popped.
    fn chain(levels: u32, before: &[u8], after: &[u8], get: u8, put: u8) -> Vec<u8> {
        let id = |op: u8, k: u32| match op {
            b'h' | b'q' => vec![op, k as u8],
            b'j' | b'r' => [&[op][..], &k.to_le_bytes()].concat(),
            0x94 => vec![op],
            _ => [&[op][..], k.to_string().as_bytes(), b"\n"].concat(),
        };
        let mut b = [&b"N"[..], &id(put, 0), b"0"].concat();
        for k in 1..=levels {
            b.extend([before, &id(get, k - 1), after, &id(put, k), b"0"].concat());
        }
        b.extend(id(get, levels));
        pickle(&b)
    }

    #[test]
    fn the_limit_is_exact_for_wrapping_opcodes() {
        let tuple1 = |n: usize| pickle(&[&b"N"[..], &b"\x85".repeat(n)].concat());
        assert!(check_nesting(&tuple1(MAX_DEPTH)).is_ok());
        assert!(refused(&tuple1(MAX_DEPTH + 1)));
        let tuple2 = |n: usize| pickle(&[&b"N"[..], &b"N\x86".repeat(n)].concat());
        assert!(check_nesting(&tuple2(MAX_DEPTH)).is_ok());
        assert!(refused(&tuple2(MAX_DEPTH + 1)));
        let tuple3 = |n: usize| pickle(&[&b"N"[..], &b"NN\x87".repeat(n)].concat());
        assert!(check_nesting(&tuple3(MAX_DEPTH)).is_ok());
        assert!(refused(&tuple3(MAX_DEPTH + 1)));
        for close in [b'l', b't', b'd', 0x91] {
            let marks = |n: usize| pickle(&[b"(".repeat(n), vec![close; n]].concat());
            assert!(check_nesting(&marks(MAX_DEPTH)).is_ok(), "{close}");
            assert!(refused(&marks(MAX_DEPTH + 1)), "{close}");
        }
    }

    #[test]
    fn every_opcode_that_nests_is_counted() {
        let cases: [(&str, &[u8], &[u8]); 13] = [
            ("TUPLE", b"(", b"t"),
            ("LIST", b"(", b"l"),
            ("DICT", b"(N", b"d"),
            ("FROZENSET", b"(", b"\x91"),
            ("INST", b"(", b"imod\nname\n"),
            ("OBJ", b"N(", b"o"),
            ("APPEND", b"]", b"a"),
            ("APPENDS", b"](", b"e"),
            ("SETITEM", b"}N", b"s"),
            ("SETITEMS", b"}(N", b"u"),
            ("ADDITEMS", b"\x8f(", b"\x90"),
            ("REDUCE", b"N", b"\x85R"),
            ("NEWOBJ", b"N", b"\x81"),
        ];
        for (name, before, after) in cases {
            assert!(
                check_nesting(&chain(100, before, after, b'j', b'r')).is_ok(),
                "{name}"
            );
            assert!(refused(&chain(5_000, before, after, b'j', b'r')), "{name}");
        }
        let more: [(&str, &[u8], &[u8]); 3] = [
            ("NEWOBJ_EX", b"N", b"N\x92"),
            ("BUILD keeps its state", b"N", b"\x85b"),
            ("TUPLE1 through the memo", b"", b"\x85"),
        ];
        for (name, before, after) in more {
            assert!(refused(&chain(5_000, before, after, b'j', b'r')), "{name}");
        }
    }

    #[test]
    fn memo_references_of_every_kind_carry_depth() {
        for (get, put) in [(b'j', b'r'), (b'g', b'p'), (b'j', 0x94)] {
            assert!(check_nesting(&chain(100, b"]", b"a", get, put)).is_ok());
            assert!(refused(&chain(5_000, b"]", b"a", get, put)), "{get} {put}");
        }
        // One-byte ids wrap around and rebind: cycles, counted whole.
        assert!(refused(&chain(5_000, b"]", b"a", b'h', b'q')));
    }

    #[test]
    fn copies_and_recursive_structures_are_bounded() {
        // DUP of a container is refused whatever the depth: each DUP + APPEND doubles the list
        // the decoder builds (`]` then `2a` x 40 asked it for 2^40 values).
        for n in [1, 40, 5_000] {
            let err = check_nesting(&pickle(&[&b"]"[..], &b"2a".repeat(n)].concat()));
            assert!(err.is_err_and(|m| m.contains("DUP")), "{n}");
        }
        // A copied scalar is harmless.
        assert!(check_nesting(&pickle(b"]N2aa")).is_ok());
        // A list that holds itself (`l = []; l.append(l)`) is one cycle of two nodes.
        assert!(check_nesting(&pickle(b"]q\x00h\x00a")).is_ok());
    }

    #[test]
    fn memo_references_that_multiply_the_decoded_values_are_refused() {
        // A list of n Nones under memo 0, then a list of n references to it: n + n^2 values
        // decoded from about 3n bytes.
        let bomb = |n: usize| {
            let mut b = b"\x80\x02]q\x00(".to_vec();
            b.extend(b"N".repeat(n));
            b.extend(b"e](");
            b.extend(b"h\x00".repeat(n));
            b.extend(b"e.");
            b
        };
        let err = check_nesting(&bomb(100_000)).unwrap_err();
        assert!(err.contains("more than"), "{err}");
        // A few hundred references to a small list are fine (real snapshots share frames).
        assert!(check_nesting(&bomb(300)).is_ok());
        // Nested sharing doubles at each level: 2^k values from 2k memo references.
        let mut b = b"\x80\x02N".to_vec();
        for level in 0..40u8 {
            b.extend([b'q', level, b'h', level, 0x86]);
        }
        b.push(b'.');
        let err = check_nesting(&b).unwrap_err();
        assert!(err.contains("memo references"), "{err}");
    }

    #[test]
    fn what_is_built_before_the_decoder_stops_counts() {
        let deep = [&b"\x80\x02N"[..], &b"\x85".repeat(5_000)].concat();
        assert!(refused(&deep), "no STOP");
        assert!(refused(&[&deep[..], b"\xff"].concat()), "unknown opcode");
        assert!(refused(&[&deep[..], b"a"].concat()), "stack underflow");
        assert!(refused(&pickle(&b"(".repeat(MAX_DEPTH + 1))), "open marks");
    }

    #[test]
    fn garbage_never_panics() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..2_000 {
            let bytes: Vec<u8> = (0..64)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = check_nesting(&bytes);
        }
    }
}
