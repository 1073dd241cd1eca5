//! Constrained decoding in the engine with hand-written constraints (no grammar engine): the
//! mask decides every token, the request ends when the constraint is complete, and a
//! constraint that panics or allows nothing fails its own request while the engine serves on.

use std::any::Any;
use std::path::Path;
use std::sync::Arc;

use strata_engine::*;
use strata_kv::memory::HeapAllocator;
use strata_kv::{CacheConfig, PageLayout, TieredCache};
use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::{Gguf, Model};

fn engine(dir: &Path) -> EngineHandle {
    let p = dir.join("tiny.gguf");
    write_tiny(&p, &TinySpec::default()).unwrap();
    let m = Model::load(&mut Gguf::open(&p).unwrap()).unwrap();
    let layout = PageLayout::new(16, vec![m.pool_kind()]).unwrap();
    let cache = TieredCache::new(CacheConfig::new(layout, 64, 0), &HeapAllocator, None).unwrap();
    Engine::start(m, cache, EngineConfig::default())
}

/// Allows exactly `seq`, one token after the other; panics on the mask at `panic_at`; allows
/// nothing at `empty_at`.
#[derive(Clone)]
struct Script {
    seq: Vec<u32>,
    panic_at: Option<usize>,
    empty_at: Option<usize>,
}

struct Running {
    s: Script,
    at: usize,
}

impl TokenConstraint for Running {
    fn mask(&mut self) -> Result<TokenMask, String> {
        if self.s.panic_at == Some(self.at) {
            panic!("scripted constraint failure");
        }
        let mut words = vec![0u32; 9];
        if self.s.empty_at != Some(self.at) {
            let t = self.s.seq[self.at];
            words[t as usize / 32] |= 1 << (t % 32);
        }
        Ok(TokenMask {
            words,
            can_end: false,
        })
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        if token != self.s.seq[self.at] {
            return Err(format!("token {token} was not allowed"));
        }
        self.at += 1;
        Ok(())
    }
    fn is_finished(&self) -> bool {
        self.at == self.s.seq.len()
    }
}

impl ConstraintSource for Script {
    fn start(&self) -> Box<dyn TokenConstraint> {
        Box::new(Running {
            s: self.clone(),
            at: 0,
        })
    }
    fn describe(&self) -> String {
        "script".into()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn run(e: &EngineHandle, s: Script, temperature: f32) -> (Vec<u32>, FinishReason) {
    let params = SamplingParams {
        max_tokens: 20,
        temperature,
        seed: Some(1),
        ignore_eos: true,
        constraint: Some(Constraint(Arc::new(s))),
        ..SamplingParams::default()
    };
    let mut rs = e.submit((1..40).collect(), params).unwrap();
    let mut out = Vec::new();
    while let Some(ev) = rs.events.blocking_recv() {
        match ev {
            Event::Token(t) => out.push(t),
            Event::Done { reason, .. } => return (out, reason),
            _ => {}
        }
    }
    panic!("no Done");
}

fn script(seq: &[u32]) -> Script {
    Script {
        seq: seq.to_vec(),
        panic_at: None,
        empty_at: None,
    }
}

#[test]
fn the_mask_decides_every_token_and_completion_ends_the_request() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    for t in [0.0, 1.0] {
        let (out, reason) = run(&e, script(&[200, 7, 99, 3]), t);
        assert_eq!(out, vec![200, 7, 99, 3], "temperature {t}");
        assert_eq!(reason, FinishReason::Stop);
    }
}

#[test]
fn a_failing_constraint_fails_its_request_and_the_engine_serves_on() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let panics = Script {
        panic_at: Some(2),
        ..script(&[5, 6, 7, 8])
    };
    let (out, reason) = run(&e, panics, 0.0);
    assert_eq!(out, vec![5, 6]);
    match reason {
        FinishReason::Error(m) => assert!(m.contains("scripted constraint failure"), "{m}"),
        r => panic!("{r:?}"),
    }
    let empty = Script {
        empty_at: Some(1),
        ..script(&[5, 6, 7])
    };
    let (out, reason) = run(&e, empty, 0.0);
    assert_eq!(out, vec![5]);
    assert!(matches!(reason, FinishReason::Error(_)), "{reason:?}");
    assert_eq!(e.health(), EngineHealth::Alive);
    let (out, reason) = run(&e, script(&[1, 2]), 0.0);
    assert_eq!((out, reason), (vec![1, 2], FinishReason::Stop));
}

/// Allows token 5 or the end (token 3) at every step.
struct FiveOrEnd;

struct FiveOrEndRunning(bool);

impl TokenConstraint for FiveOrEndRunning {
    fn mask(&mut self) -> Result<TokenMask, String> {
        let mut words = vec![0u32; 9];
        words[0] = 1 << 5 | 1 << 3;
        Ok(TokenMask {
            words,
            can_end: true,
        })
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        self.0 |= token == 3;
        Ok(())
    }
    fn is_finished(&self) -> bool {
        self.0
    }
}

impl ConstraintSource for FiveOrEnd {
    fn start(&self) -> Box<dyn TokenConstraint> {
        Box::new(FiveOrEndRunning(false))
    }
    fn describe(&self) -> String {
        "five or end".into()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `ignore_eos` under a constraint: the end-of-sequence token is not chosen while the
/// constraint allows another (even biased far above it); without it, it ends the answer.
#[test]
fn ignore_eos_holds_the_end_while_the_constraint_allows_more() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("tiny.gguf");
    write_tiny(&p, &TinySpec::default()).unwrap();
    let m = Model::load(&mut Gguf::open(&p).unwrap()).unwrap();
    let layout = PageLayout::new(16, vec![m.pool_kind()]).unwrap();
    let cache = TieredCache::new(CacheConfig::new(layout, 64, 0), &HeapAllocator, None).unwrap();
    let cfg = EngineConfig {
        stop_token_ids: vec![3],
        ..EngineConfig::default()
    };
    let e = Engine::start(m, cache, cfg);
    for ignore_eos in [true, false] {
        let params = SamplingParams {
            max_tokens: 6,
            ignore_eos,
            logit_bias: vec![(3, 100.0)],
            constraint: Some(Constraint(Arc::new(FiveOrEnd))),
            ..SamplingParams::default()
        };
        let mut rs = e.submit((1..40).collect(), params).unwrap();
        let mut out = Vec::new();
        let reason = loop {
            match rs.events.blocking_recv() {
                Some(Event::Token(t)) => out.push(t),
                Some(Event::Done { reason, .. }) => break reason,
                Some(_) => {}
                None => panic!("no Done"),
            }
        };
        if ignore_eos {
            assert_eq!((out, reason), (vec![5; 6], FinishReason::Length));
        } else {
            assert_eq!((out, reason), (vec![], FinishReason::Stop));
        }
    }
}
