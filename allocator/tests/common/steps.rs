//! Sequences of allocations for the layout-plan tests (`policies/plans.rs`,
//! `policies/split_footprints.rs`): steps in units of a batch's scale, BERT's layers, random
//! sequences, and a player that checks the pool after every step.
#![allow(dead_code)]

use super::pool::{check, Sim, S0};
use super::Rng;
use cudalloc::{Allocation, Pool};

/// One step of a repeated sequence: allocate `units` into `slot`, or free `slot`.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    Alloc { slot: usize, units: u64 },
    Free { slot: usize },
}

/// A sequence in the making.
#[derive(Default)]
pub struct Tape {
    pub steps: Vec<Step>,
    next: usize,
}

impl Tape {
    pub fn alloc(&mut self, units: u64) -> usize {
        self.steps.push(Step::Alloc {
            slot: self.next,
            units,
        });
        self.next += 1;
        self.next - 1
    }
    pub fn free(&mut self, slots: &[usize]) {
        self.steps
            .extend(slots.iter().map(|&slot| Step::Free { slot }));
    }
}

/// BERT's encoder layers in units of the hidden state (attention scores are 4 units): a mask
/// lives throughout, each layer's output lives into the next layer.
pub fn bert_batch(layers: usize) -> Vec<Step> {
    let mut tape = Tape::default();
    let mask = tape.alloc(1);
    let mut x = tape.alloc(1);
    for _ in 0..layers {
        let a: Vec<usize> = (0..4).map(|_| tape.alloc(1)).collect();
        tape.free(&a[..3]);
        let b: Vec<usize> = (0..3).map(|_| tape.alloc(1)).collect();
        tape.free(&[b[1], b[0], a[3]]);
        let s1 = tape.alloc(4);
        let s2 = tape.alloc(4);
        tape.free(&[s1]);
        let o: Vec<usize> = (0..3).map(|_| tape.alloc(1)).collect();
        tape.free(&[o[1], o[0], s2, b[2], x]);
        x = o[2];
    }
    tape.free(&[x, mask]);
    tape.steps
}

pub fn play(sim: &Sim, pool: &mut Pool<Sim>, steps: &[Step], unit: u64) {
    play_resized(sim, pool, steps, unit, |size| size);
}

/// [`play`], each request's size passed through `resize` first.
pub fn play_resized(
    sim: &Sim,
    pool: &mut Pool<Sim>,
    steps: &[Step],
    unit: u64,
    mut resize: impl FnMut(u64) -> u64,
) {
    let pool = std::cell::RefCell::new(pool);
    drive(
        steps,
        unit,
        |size| {
            let a = pool.borrow_mut().allocate(resize(size), S0).unwrap();
            check(sim, &pool.borrow());
            a
        },
        |a| {
            pool.borrow_mut().free(a).unwrap();
            check(sim, &pool.borrow());
        },
    );
}

/// Runs `steps` with `unit` bytes per unit through `alloc` and `free`; frees what is left.
pub fn drive(
    steps: &[Step],
    unit: u64,
    mut alloc: impl FnMut(u64) -> Allocation,
    mut free: impl FnMut(Allocation),
) {
    let mut live: Vec<Option<Allocation>> = Vec::new();
    for &s in steps {
        match s {
            Step::Alloc { slot, units } => {
                if live.len() <= slot {
                    live.resize_with(slot + 1, || None);
                }
                live[slot] = Some(alloc(units * unit));
            }
            Step::Free { slot } => free(live[slot].take().expect("freed twice")),
        }
    }
    live.into_iter().flatten().for_each(free);
}

/// A random sequence of allocations and frees of 1-6 units that ends with nothing live.
pub fn random_batch(rng: &mut Rng, len: usize) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut live: Vec<usize> = Vec::new();
    let mut next = 0;
    for _ in 0..len {
        if live.is_empty() || rng.below(100) < 55 {
            steps.push(Step::Alloc {
                slot: next,
                units: rng.range(1, 7),
            });
            live.push(next);
            next += 1;
        } else {
            let slot = live.swap_remove(rng.below(live.len() as u64) as usize);
            steps.push(Step::Free { slot });
        }
    }
    steps.extend(live.into_iter().map(|slot| Step::Free { slot }));
    steps
}
