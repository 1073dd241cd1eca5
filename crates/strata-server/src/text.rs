//! Generated ids → text deltas, as they come: multi-byte characters split over tokens are held
//! until complete, and text that may be the start of a stop string is held until it is known
//! not to be (a stop string found ends the text before it). Control tokens (`<|im_end|>`,
//! `<|endoftext|>`: generated past the end with `ignore_eos`, or forced by `logit_bias`) are
//! counted and leave no text, as `skip_special_tokens` says; their log probabilities still go
//! out.

use strata_model::ModelTokenizer;

/// Incremental detokenizer for one completion.
pub struct TextStream {
    /// The tokens whose text is decoded (control tokens left out).
    ids: Vec<u32>,
    /// Every token pushed, control tokens included.
    total: usize,
    /// Decoding restarts at `prefix` (a few tokens back, for context) and text from `read`
    /// onwards is new.
    prefix: usize,
    read: usize,
    /// Decoded text not released yet (possible start of a stop string).
    held: String,
    stops: Vec<String>,
    stopped: bool,
    /// Stop strings count only once this many tokens were generated (`min_tokens`).
    min_tokens: usize,
    /// Bytes of text decoded and released so far, and where each token's text ends (tokens
    /// counted, bytes decoded) for tokens not yet wholly released.
    decoded: usize,
    released: usize,
    ends: std::collections::VecDeque<(usize, usize)>,
    /// Tokens whose text is wholly out (released, or cut by a stop string).
    settled: usize,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> TextStream {
        TextStream {
            ids: Vec::new(),
            total: 0,
            prefix: 0,
            read: 0,
            held: String::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            stopped: false,
            min_tokens: 0,
            decoded: 0,
            released: 0,
            ends: Default::default(),
            settled: 0,
        }
    }

    /// Stop strings are not looked for before `n` tokens (text generated before then is
    /// released as it comes).
    pub fn with_min_tokens(mut self, n: usize) -> TextStream {
        self.min_tokens = n;
        self
    }

    /// True once a stop string was found: nothing more will be released.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Tokens whose text is wholly out: released, or past a stop string (every token once
    /// stopped or finished). A token's log probability goes out with the text that ends it.
    pub fn settled(&self) -> usize {
        self.settled
    }

    /// Adds one token; returns the text that can be released now.
    pub fn push(&mut self, tk: &ModelTokenizer, id: u32) -> String {
        if self.stopped {
            return String::new();
        }
        self.total += 1;
        if tk.is_control(id) {
            // No text: settled once the text before it is out.
            if self.read == self.ids.len() {
                self.ends.push_back((self.total, self.decoded));
                return self.release();
            }
            return String::new();
        }
        self.ids.push(id);
        let before = tk
            .decode_fragment(&self.ids[self.prefix..self.read])
            .unwrap_or_default();
        let now = tk
            .decode_fragment(&self.ids[self.prefix..])
            .unwrap_or_default();
        if now.len() <= before.len()
            || now.ends_with('\u{fffd}')
            || !now.is_char_boundary(before.len())
        {
            return String::new(); // an incomplete character: wait for the next token
        }
        let delta = &now[before.len()..];
        self.prefix = self.read;
        self.read = self.ids.len();
        self.held.push_str(delta);
        self.decoded += delta.len();
        self.ends.push_back((self.total, self.decoded));
        self.release()
    }

    /// Text still held at the end of generation (no stop string came), the last tokens'
    /// included though they end in the middle of a character (its bytes shown as `�`, as a
    /// whole decode shows them: generated and counted, never dropped).
    pub fn finish(&mut self, tk: &ModelTokenizer) -> String {
        self.settle_all();
        if self.stopped {
            return String::new();
        }
        if self.read < self.ids.len() {
            // The tokens held back are the bytes of a character not complete: each maximal
            // bad sequence is one `�` (a decoder's own fallback may say more: SentencePiece's
            // takes a whole run of byte tokens as bad for one bad byte in it).
            let bytes: Vec<u8> = self.ids[self.read..]
                .iter()
                .flat_map(|&id| tk.token_bytes(id).unwrap_or_default())
                .collect();
            self.held.push_str(&String::from_utf8_lossy(&bytes));
            self.read = self.ids.len();
            // A stop string in the tail still cuts it.
            let out = self.release();
            return out + &std::mem::take(&mut self.held);
        }
        std::mem::take(&mut self.held)
    }

    fn settle_all(&mut self) {
        self.settled = self.total;
        self.ends.clear();
    }

    fn release(&mut self) -> String {
        let out = self.cut();
        self.released += out.len();
        while let Some(&(tokens, end)) = self.ends.front() {
            if end > self.released {
                break;
            }
            self.settled = tokens;
            self.ends.pop_front();
        }
        out
    }

    /// The held text that can go out now (all of it, or what precedes a stop string or a
    /// possible start of one).
    fn cut(&mut self) -> String {
        if self.total < self.min_tokens {
            return std::mem::take(&mut self.held);
        }
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.stopped = true;
            self.settle_all();
            let out = self.held[..at].to_string();
            self.held.clear();
            return out;
        }
        // Keep the longest tail that is a prefix of some stop string (only tails shorter than
        // the stop string can be: the work per token is bounded by the stop strings' lengths).
        let mut keep = 0;
        for s in &self.stops {
            let from = self.held.len().saturating_sub(s.len());
            for (i, _) in self.held[..].char_indices().filter(|(i, _)| *i >= from) {
                let tail = &self.held[i..];
                if tail.len() > keep && s.starts_with(tail) {
                    keep = tail.len();
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_model::tiny::{write_tiny, TinySpec};
    use strata_model::Gguf;

    fn tk() -> (tempfile::TempDir, ModelTokenizer) {
        tk_of(&TinySpec::default())
    }

    fn tk_of(spec: &TinySpec) -> (tempfile::TempDir, ModelTokenizer) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.gguf");
        write_tiny(&p, spec).unwrap();
        let g = Gguf::open(&p).unwrap();
        let t = ModelTokenizer::from_gguf(&g).unwrap();
        (d, t)
    }

    fn stream_all(tk: &ModelTokenizer, text: &str, stops: &[&str]) -> (String, bool) {
        let ids = tk.encode(text).unwrap();
        let mut s = TextStream::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for id in ids {
            out += &s.push(tk, id);
        }
        out += &s.finish(tk);
        (out, s.stopped())
    }

    /// Control tokens leave no text (`skip_special_tokens`), wherever they come: first, between
    /// the bytes of one character, last; every token is still settled, and counts toward
    /// `min_tokens`.
    #[test]
    fn control_tokens_leave_no_text_and_are_settled() {
        let (_d, tk) = tk();
        let end = tk.token_to_id("<|im_end|>").or(tk.bos).unwrap();
        assert!(tk.is_control(end));
        let text = "héllo 東京";
        let ids = tk.encode(text).unwrap();
        // A multi-byte character split over tokens: the control token between its bytes.
        let split = (1..ids.len())
            .find(|&i| tk.decode_fragment(&ids[..i]).unwrap().ends_with('\u{fffd}'))
            .unwrap_or(1);
        let mut with: Vec<u32> = vec![end];
        with.extend(&ids[..split]);
        with.push(end);
        with.extend(&ids[split..]);
        with.push(end);
        let mut s = TextStream::new(vec![]);
        let mut out = String::new();
        for &id in &with {
            out += &s.push(&tk, id);
        }
        out += &s.finish(&tk);
        assert_eq!(out, tk.decode_fragment(&ids).unwrap());
        assert!(!out.contains("<|"), "{out}");
        assert_eq!(s.settled(), with.len());
        // Stop strings wait for `min_tokens` counted with the control tokens.
        let mut s = TextStream::new(vec!["llo".into()]).with_min_tokens(2);
        let mut out = s.push(&tk, end);
        for &id in &ids {
            out += &s.push(&tk, id);
        }
        assert!(s.stopped() && out.starts_with("hé"), "{out}");
    }

    #[test]
    fn deltas_concatenate_to_the_text_even_for_multibyte_characters() {
        // Byte-level BPE, and SentencePiece (spaces as `▁`, the leading one stripped, byte
        // tokens for what no piece covers).
        for spec in [TinySpec::default(), TinySpec::family("mistral").unwrap()] {
            let (_d, tk) = tk_of(&spec);
            for text in [
                "hello world",
                "héllo wörld — ½ 東京",
                "a\nb\tc  d",
                "  two  spaces",
            ] {
                let (out, stopped) = stream_all(&tk, text, &[]);
                assert_eq!(out, tk.decode_fragment(&tk.encode(text).unwrap()).unwrap());
                // A SentencePiece text starts with `▁` (the space before every text), and the
                // stream keeps it as llama.cpp's pieces do.
                let want = if spec.spm {
                    format!(" {text}")
                } else {
                    text.to_string()
                };
                assert_eq!(out, want, "{}", spec.spm);
                assert!(!stopped);
            }
        }
    }

    #[test]
    fn stop_strings_cut_the_text_and_partial_matches_are_released() {
        let (_d, tk) = tk();
        assert_eq!(
            stream_all(&tk, "one two three", &["two"]),
            ("one ".into(), true)
        );
        assert_eq!(
            stream_all(&tk, "one two three", &["thr", "o t"]),
            ("one tw".into(), true)
        );
        // "tw" looked like the start of "twice" but was not: released in full.
        assert_eq!(
            stream_all(&tk, "one two", &["twice"]),
            ("one two".into(), false)
        );
    }

    #[test]
    fn stop_strings_do_not_count_before_min_tokens() {
        let (_d, tk) = tk();
        let ids = tk.encode("one two one two").unwrap();
        let run = |min: usize| {
            let mut s = TextStream::new(vec!["two".into()]).with_min_tokens(min);
            let mut out = String::new();
            for &id in &ids {
                out += &s.push(&tk, id);
            }
            out += &s.finish(&tk);
            out
        };
        assert_eq!(run(0), "one ");
        // The first "two" arrives before min_tokens: only the second one stops.
        let first_two = (1..=ids.len())
            .find(|&n| tk.decode(&ids[..n]).unwrap().contains("two"))
            .unwrap();
        assert_eq!(run(first_two + 1), "one two one ");
    }

    /// A generation cut in the middle of a character ends with its bytes shown as `�`, not
    /// with nothing: the text is the tokens' bytes, read as UTF-8 with each bad sequence a `�`.
    #[test]
    fn a_character_cut_at_the_end_is_shown_not_dropped() {
        for spec in [TinySpec::default(), TinySpec::family("mistral").unwrap()] {
            let (_d, tk) = tk_of(&spec);
            let ids = tk.encode("ab 東京").unwrap();
            for n in 1..ids.len() {
                let mut s = TextStream::new(Vec::new());
                let mut out = String::new();
                for &id in &ids[..n] {
                    out += &s.push(&tk, id);
                }
                out += &s.finish(&tk);
                let bytes: Vec<u8> = ids[..n]
                    .iter()
                    .flat_map(|&i| tk.token_bytes(i).unwrap())
                    .collect();
                assert_eq!(out, String::from_utf8_lossy(&bytes), "{n} of {ids:?}");
                if n == ids.len() - 1 {
                    assert!(
                        out.ends_with(" 東\u{fffd}"),
                        "{out}: no cut character to test"
                    );
                }
            }
        }
    }

    /// A token is settled once all of its text is out: a possible stop string's start and
    /// the first half of a character hold their tokens back; a stop string settles all.
    #[test]
    fn tokens_settle_when_their_text_is_out() {
        let (_d, tk) = tk();
        let ids = tk.encode("one 東 two").unwrap();
        let mut s = TextStream::new(vec!["two!".into()]);
        let (mut out, mut text) = (String::new(), String::new());
        for (n, &id) in ids.iter().enumerate() {
            out += &s.push(&tk, id);
            text = tk.decode(&ids[..=n]).unwrap();
            // Every settled token's text is out; the rest of the text is held or incomplete.
            let settled = tk.decode(&ids[..s.settled()]).unwrap();
            assert!(out.starts_with(&settled), "{settled:?} / {out:?}");
            assert!(s.settled() <= n + 1);
        }
        assert!(
            out.len() < text.len() && s.settled() < ids.len(),
            "no text held back"
        );
        out += &s.finish(&tk);
        assert_eq!((out, s.settled()), (text, ids.len()));
        let mut s = TextStream::new(vec!["e 東".into()]);
        for &id in &ids {
            s.push(&tk, id);
        }
        assert!(s.stopped() && s.settled() == s.ids.len());
    }
}
