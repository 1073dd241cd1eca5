//! Request generators. Every generator is a pure function of its parameters and seed: the same
//! seed gives the same requests, so configurations compared side by side see one workload.

use std::path::PathBuf;

use thiserror::Error;

/// A workload that cannot be run, named before any request is sent.
#[derive(Debug, Error, PartialEq)]
pub enum WorkloadError {
    #[error("{what} must be at least 1 (got {got})")]
    Zero { what: &'static str, got: usize },
    #[error("{what} must be a number > 0 and at most {MAX_SCALE} (got {})", strata_kv::units::shown_number(*.got))]
    Scale { what: &'static str, got: f64 },
    #[error("trace {path}: {msg}")]
    Trace { path: String, msg: String },
}

fn nonzero(what: &'static str, got: usize) -> Result<(), WorkloadError> {
    if got == 0 {
        Err(WorkloadError::Zero { what, got })
    } else {
        Ok(())
    }
}

/// SplitMix64 (`strata_kv::rng`): the generators' only source of randomness.
pub type Rng = strata_sim::tokens::SplitMix64;

const SYLLABLES: [&str; 24] = [
    "ka", "lo", "mi", "ra", "te", "su", "vo", "ne", "pa", "di", "gu", "fe", "sho", "ban", "tri",
    "quo", "zel", "mar", "ost", "lin", "dra", "pex", "ul", "ny",
];

/// `n` pseudo-words (a few tokens each): text whose length scales with `n`.
pub fn words(rng: &mut Rng, n: usize) -> String {
    let mut s = String::new();
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        for _ in 0..1 + rng.next_u64() % 3 {
            s.push_str(SYLLABLES[(rng.next_u64() % SYLLABLES.len() as u64) as usize]);
        }
    }
    s
}

/// N clients × R rounds of chat: every client starts with the same system prompt, and each
/// round appends the model's answer and a new user turn (the runner fills in the answers).
/// The first user turn may be longer (a document the conversation is about, private to the
/// client).
#[derive(Clone, Debug, PartialEq)]
pub struct MultiTurn {
    pub clients: usize,
    pub rounds: usize,
    pub system_words: usize,
    pub user_words: usize,
    /// Words of each client's first user turn (0: `user_words`).
    pub first_words: usize,
    pub max_tokens: usize,
    pub seed: u64,
}

/// One client's conversation: the shared system prompt and its user turns, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conversation {
    pub system: String,
    pub user_turns: Vec<String>,
}

impl MultiTurn {
    pub fn check(&self) -> Result<(), WorkloadError> {
        nonzero("clients", self.clients)?;
        nonzero("rounds", self.rounds)?;
        nonzero("user words", self.user_words)?;
        nonzero("max_tokens", self.max_tokens)
    }

    pub fn conversations(&self) -> Result<Vec<Conversation>, WorkloadError> {
        self.check()?;
        let mut rng = Rng::new(self.seed);
        let system = words(&mut rng, self.system_words);
        Ok((0..self.clients)
            .map(|c| {
                let mut r =
                    Rng::new(self.seed ^ (c as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
                Conversation {
                    system: system.clone(),
                    user_turns: (0..self.rounds)
                        .map(|i| {
                            let n = if i == 0 && self.first_words > 0 {
                                self.first_words
                            } else {
                                self.user_words
                            };
                            words(&mut r, n)
                        })
                        .collect(),
                }
            })
            .collect())
    }
}

/// G groups of requests; the requests of a group share a long prefix and differ in a short
/// suffix; groups share nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedPrefix {
    pub groups: usize,
    pub per_group: usize,
    pub prefix_words: usize,
    pub suffix_words: usize,
    pub max_tokens: usize,
    pub seed: u64,
}

/// One request of a shared-prefix workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixRequest {
    pub group: usize,
    pub prefix: String,
    pub suffix: String,
}

impl SharedPrefix {
    pub fn check(&self) -> Result<(), WorkloadError> {
        nonzero("groups", self.groups)?;
        nonzero("requests per group", self.per_group)?;
        nonzero("prefix words", self.prefix_words)?;
        nonzero("suffix words", self.suffix_words)?;
        nonzero("max_tokens", self.max_tokens)
    }

    /// The requests, groups interleaved (round-robin), so a group's repeats arrive spread out.
    pub fn requests(&self) -> Result<Vec<PrefixRequest>, WorkloadError> {
        self.check()?;
        let mut rng = Rng::new(self.seed);
        let prefixes: Vec<String> = (0..self.groups)
            .map(|g| format!("[document {g}] {}", words(&mut rng, self.prefix_words)))
            .collect();
        let mut out = Vec::with_capacity(self.groups * self.per_group);
        for i in 0..self.per_group {
            for (g, p) in prefixes.iter().enumerate() {
                out.push(PrefixRequest {
                    group: g,
                    prefix: p.clone(),
                    suffix: format!("question {i}: {}", words(&mut rng, self.suffix_words)),
                });
            }
        }
        Ok(out)
    }
}

/// N agents × S steps of tool use: every agent shares the system prompt (and the tool
/// definitions the runner adds to it), works on its own task, and each step but the last calls
/// a tool whose result (seeded text, private to the agent and step) joins the conversation;
/// the last step answers. The context grows by a call and a result per step.
#[derive(Clone, Debug, PartialEq)]
pub struct Agent {
    pub clients: usize,
    /// Requests per agent (the last one answers instead of calling a tool).
    pub steps: usize,
    pub system_words: usize,
    /// Words of each agent's task (its first user turn).
    pub task_words: usize,
    /// Words of each tool result.
    pub result_words: usize,
    pub seed: u64,
}

/// One agent's run: the shared system prompt, its task, the result of each tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentTask {
    pub system: String,
    pub task: String,
    /// `steps - 1` results, in order.
    pub results: Vec<String>,
}

impl Agent {
    pub fn check(&self) -> Result<(), WorkloadError> {
        nonzero("clients", self.clients)?;
        nonzero("steps", self.steps)?;
        nonzero("task words", self.task_words)?;
        nonzero("result words", self.result_words)
    }

    pub fn tasks(&self) -> Result<Vec<AgentTask>, WorkloadError> {
        self.check()?;
        let mut rng = Rng::new(self.seed ^ 0xA6E7);
        let system = words(&mut rng, self.system_words);
        Ok((0..self.clients)
            .map(|c| {
                let mut r =
                    Rng::new(self.seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                AgentTask {
                    system: system.clone(),
                    task: format!("task {c}: {}", words(&mut r, self.task_words)),
                    results: (1..self.steps)
                        .map(|_| words(&mut r, self.result_words))
                        .collect(),
                }
            })
            .collect())
    }
}

/// Replay of a Mooncake-format trace: each hash id becomes a fixed block of token ids (equal
/// ids, equal tokens), lengths scaled by `length_scale`, arrival times by `time_scale`
/// (0.5 = twice as fast).
#[derive(Clone, Debug, PartialEq)]
pub struct TraceReplay {
    pub path: PathBuf,
    /// Tokens per hash id in the trace (Mooncake: 512).
    pub block_tokens: usize,
    pub length_scale: f64,
    pub time_scale: f64,
    /// Token ids are drawn below this (the model's vocabulary).
    pub vocab: u32,
    /// Requests taken from the start of the trace (0: all).
    pub limit: usize,
    /// Output tokens per request, capped by the trace's own output length × `length_scale`.
    pub max_tokens: usize,
}

/// One replayed request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimedRequest {
    /// Microseconds after the start.
    pub at_us: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// The trace's `session_id`, as its stable hash (sent as `prompt_cache_key`).
    pub session: Option<u64>,
}

/// Largest length or time scale (past it a value is a typo).
const MAX_SCALE: f64 = 1e6;
/// Latest arrival a replay waits for, in µs (a week).
const MAX_REPLAY_US: f64 = 7.0 * 86_400.0 * 1e6;

impl TraceReplay {
    pub fn check(&self) -> Result<(), WorkloadError> {
        nonzero("block tokens", self.block_tokens)?;
        nonzero("max_tokens", self.max_tokens)?;
        nonzero("vocabulary", self.vocab as usize)?;
        for (what, got) in [
            ("length scale", self.length_scale),
            ("time scale", self.time_scale),
        ] {
            if !(got > 0.0 && got <= MAX_SCALE) {
                return Err(WorkloadError::Scale { what, got });
            }
        }
        Ok(())
    }

    /// Reads and maps the trace; a malformed line is an error naming it.
    pub fn requests(&self) -> Result<Vec<TimedRequest>, WorkloadError> {
        self.check()?;
        let err = |msg: String| WorkloadError::Trace {
            path: self.path.display().to_string(),
            msg,
        };
        let f = std::fs::File::open(&self.path).map_err(|e| err(e.to_string()))?;
        let trace = strata_sim::trace::read_trace_first(
            std::io::BufReader::new(f),
            self.block_tokens,
            self.limit,
        )
        .map_err(|e| err(e.to_string()))?;
        if !trace.unread_fields.is_empty() {
            let names: Vec<&str> = trace.unread_fields.iter().map(String::as_str).collect();
            eprintln!("strata bench: trace fields not read: {}", names.join(", "));
        }
        let trace = trace.requests;
        let t0 = trace[0].timestamp_ms;
        let scale =
            strata_sim::trace::Scale::new(self.block_tokens, self.length_scale).map_err(&err)?;
        trace
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let len = scale.prompt(i, r).map_err(&err)?;
                let out = scale.output(r);
                let Some(dt) = r.timestamp_ms.checked_sub(t0) else {
                    return Err(err(format!(
                        "request {}: timestamp {} is before the first request's ({t0})",
                        i + 1,
                        r.timestamp_ms
                    )));
                };
                let at_us = dt as f64 * self.time_scale * 1e3;
                if at_us > MAX_REPLAY_US {
                    return Err(err(format!(
                        "request {}: timestamp {} arrives {:.0} s after the first request's \
                         ({t0}) × the time scale: a replay lasts at most a week (timestamps are \
                         milliseconds)",
                        i + 1,
                        r.timestamp_ms,
                        at_us / 1e6
                    )));
                }
                Ok(TimedRequest {
                    at_us: at_us as u64,
                    prompt: strata_sim::tokens::request_tokens(
                        &r.hash_ids,
                        len,
                        scale.block,
                        self.vocab,
                    ),
                    max_tokens: out.min(self.max_tokens),
                    session: r.session,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mt(seed: u64) -> MultiTurn {
        MultiTurn {
            clients: 4,
            rounds: 3,
            system_words: 50,
            user_words: 8,
            first_words: 0,
            max_tokens: 16,
            seed,
        }
    }

    #[test]
    fn a_long_first_turn_is_private_to_its_client() {
        let mut w = mt(1);
        w.first_words = 300;
        let a = w.conversations().unwrap();
        for c in &a {
            assert_eq!(c.user_turns[0].split(' ').count(), 300);
            assert!(c.user_turns[1..].iter().all(|t| t.split(' ').count() == 8));
        }
        // Two clients' documents share no long run of words.
        let w0: Vec<&str> = a[0].user_turns[0].split(' ').collect();
        let w1 = &a[1].user_turns[0];
        assert!(w0.windows(6).all(|g| !w1.contains(&g.join(" "))));
    }

    #[test]
    fn multi_turn_is_deterministic_and_shares_the_system_prompt() {
        let a = mt(1).conversations().unwrap();
        assert_eq!(a, mt(1).conversations().unwrap());
        assert_ne!(a, mt(2).conversations().unwrap());
        assert_eq!(a.len(), 4);
        assert!(a
            .iter()
            .all(|c| c.system == a[0].system && c.user_turns.len() == 3));
        // Clients ask different things.
        assert_ne!(a[0].user_turns, a[1].user_turns);
        assert_eq!(a[0].system.split(' ').count(), 50);
    }

    #[test]
    fn agents_share_the_system_prompt_and_own_their_task_and_results() {
        let w = Agent {
            clients: 3,
            steps: 4,
            system_words: 20,
            task_words: 30,
            result_words: 10,
            seed: 5,
        };
        let a = w.tasks().unwrap();
        assert_eq!(a, w.tasks().unwrap());
        assert_eq!(a.len(), 3);
        for t in &a {
            assert_eq!(t.system, a[0].system);
            assert_eq!(t.results.len(), 3);
            assert!(t.results.iter().all(|r| r.split(' ').count() == 10));
        }
        assert_ne!(a[0].task, a[1].task);
        assert_ne!(a[0].results, a[1].results);
        let none = Agent { steps: 0, ..w };
        assert_eq!(
            none.tasks().err(),
            Some(WorkloadError::Zero {
                what: "steps",
                got: 0
            })
        );
    }

    #[test]
    fn shared_prefix_groups_share_exactly_their_prefix() {
        let w = SharedPrefix {
            groups: 3,
            per_group: 4,
            prefix_words: 40,
            suffix_words: 5,
            max_tokens: 8,
            seed: 9,
        };
        let r = w.requests().unwrap();
        assert_eq!(r, w.requests().unwrap());
        assert_eq!(r.len(), 12);
        for a in &r {
            for b in &r {
                assert_eq!(a.prefix == b.prefix, a.group == b.group);
            }
        }
        let mut suffixes: Vec<&str> = r.iter().map(|x| x.suffix.as_str()).collect();
        suffixes.sort_unstable();
        suffixes.dedup();
        assert_eq!(suffixes.len(), 12, "suffixes are distinct");
        assert_eq!(r[0].group, 0);
        assert_eq!(r[1].group, 1, "groups interleave");
    }

    #[test]
    fn bad_parameters_are_refused_before_anything_runs() {
        let mut w = mt(1);
        w.clients = 0;
        assert_eq!(
            w.conversations().unwrap_err().to_string(),
            "clients must be at least 1 (got 0)"
        );
        let t = TraceReplay {
            path: "/nonexistent".into(),
            block_tokens: 512,
            length_scale: 0.0,
            time_scale: 1.0,
            vocab: 100,
            limit: 0,
            max_tokens: 8,
        };
        assert!(t
            .requests()
            .unwrap_err()
            .to_string()
            .contains("length scale"));
        let t = TraceReplay {
            length_scale: 1.0,
            ..t
        };
        assert!(t
            .requests()
            .unwrap_err()
            .to_string()
            .starts_with("trace /nonexistent"));
        let huge = TraceReplay {
            time_scale: 1e300,
            ..t.clone()
        };
        let e = huge.requests().unwrap_err().to_string();
        assert!(
            e.starts_with("time scale must be a number > 0 and at most"),
            "{e}"
        );
        // A timestamp a replay would wait on for ever (584,000 years at 2^64 - 1 ms).
        let d = std::env::temp_dir().join(format!("strata-bench-late-{}", std::process::id()));
        std::fs::write(
            &d,
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 18446744073709551615, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n",
        )
        .unwrap();
        let late = TraceReplay {
            path: d.clone(),
            ..t
        };
        let e = late.requests().unwrap_err().to_string();
        std::fs::remove_file(&d).unwrap();
        assert!(
            e.contains("request 2: timestamp 18446744073709551615 arrives"),
            "{e}"
        );
    }

    #[test]
    fn trace_replay_keeps_sharing_and_scales_lengths_and_times() {
        let d = std::env::temp_dir().join(format!("strata-bench-trace-{}", std::process::id()));
        std::fs::write(
            &d,
            "{\"timestamp\": 1000, \"input_length\": 1000, \"output_length\": 10, \"hash_ids\": [1, 2]}\n\
             {\"timestamp\": 3000, \"input_length\": 900, \"output_length\": 10, \"hash_ids\": [1, 3]}\n",
        )
        .unwrap();
        let t = TraceReplay {
            path: d.clone(),
            block_tokens: 512,
            length_scale: 0.25,
            time_scale: 0.5,
            vocab: 49152,
            limit: 0,
            max_tokens: 100,
        };
        let r = t.requests().unwrap();
        std::fs::remove_file(&d).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].prompt.len(), 250);
        assert_eq!(r[1].prompt.len(), 225);
        // Block 1 (128 scaled tokens) is shared; blocks 2 and 3 differ.
        assert_eq!(r[0].prompt[..128], r[1].prompt[..128]);
        assert_ne!(r[0].prompt[128..200], r[1].prompt[128..200]);
        assert_eq!((r[0].at_us, r[1].at_us), (0, 1_000_000));
        assert_eq!(r[0].max_tokens, 3);
    }
}
