//! A token's own bytes (chat logprobs' `bytes`): what the token adds to the output, even where
//! it is a part of a UTF-8 character that its text alone cannot show (its text is then `�`).

use super::{ModelTokenizer, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED};

/// SentencePiece's byte-fallback tokens (`<0xF0>`).
pub(super) const TOKEN_TYPE_BYTE: i32 = 6;

/// The bytes GPT-2's byte-level alphabet shows as themselves; the others (0–32, 127–160,
/// 173) were given the chars from U+0100 up, in byte order.
fn shown_as_itself(b: u32) -> bool {
    (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b)
}

/// The byte a byte-level vocabulary piece's char stands for.
pub(super) fn byte_of_char(c: char) -> Option<u8> {
    let c = c as u32;
    if c < 256 {
        return shown_as_itself(c).then_some(c as u8);
    }
    let n = c - 256;
    match n {
        0..=32 => Some(n as u8),
        33..=66 => Some((127 + n - 33) as u8),
        67 => Some(173),
        _ => None,
    }
}

impl ModelTokenizer {
    /// The bytes token `id` adds to a text (None: not in the vocabulary). Special tokens are
    /// their text; a byte-level piece maps back char by char; a SentencePiece byte token
    /// (`<0xF0>`) is its byte, another piece its text with `▁` a space.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        let kind = i32::from(self.types.get(id as usize).copied().unwrap_or(0));
        let special = [
            TOKEN_TYPE_CONTROL,
            TOKEN_TYPE_USER_DEFINED,
            TOKEN_TYPE_UNKNOWN,
        ];
        if special.contains(&kind) {
            return Some(piece.into_bytes());
        }
        if self.byte_level {
            let mapped: Option<Vec<u8>> = piece.chars().map(byte_of_char).collect();
            return Some(mapped.unwrap_or_else(|| piece.into_bytes()));
        }
        let hex = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
        match hex.map(|h| u8::from_str_radix(h, 16)) {
            Some(Ok(b)) if kind == TOKEN_TYPE_BYTE && hex.is_some_and(|h| h.len() == 2) => {
                Some(vec![b])
            }
            _ => Some(piece.replace('\u{2581}', " ").into_bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The alphabet is a bijection of the 256 bytes onto their chars, as GPT-2 built it.
    #[test]
    fn every_byte_has_one_char_and_back() {
        let mut next = 256u32;
        let mut seen = std::collections::HashSet::new();
        for b in 0u32..256 {
            let c = if shown_as_itself(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            let c = char::from_u32(c).unwrap();
            assert_eq!(byte_of_char(c), Some(b as u8), "byte {b}");
            assert!(seen.insert(c));
        }
        assert_eq!(next, 256 + 68);
        assert_eq!(byte_of_char('Ġ'), Some(b' '));
        assert_eq!(byte_of_char('Ċ'), Some(b'\n'));
        assert_eq!(byte_of_char(char::from_u32(256 + 68).unwrap()), None);
        assert_eq!(byte_of_char('\u{7f}'), None);
    }
}
