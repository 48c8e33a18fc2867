//! Tokenizers: from `tokenizer.json`, or rebuilt in Rust from a GGUF file's `tokenizer.ggml.*`
//! metadata: byte-level BPE (`gpt2`: vocab, merges, pre-tokenizer, special tokens) or
//! SentencePiece BPE (`llama`: vocab, scores, byte fallback, `add_space_prefix`).

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, NormalizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::ModelError;

/// GGUF token types (llama.cpp `llama_token_type`): control and user-defined tokens are matched
/// whole in input text, never split by BPE.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;
const TOKEN_TYPE_BYTE: i32 = 6;
/// SentencePiece's stand-in for a space.
const SPM_SPACE: char = '\u{2581}';

// Pre-tokenizer regexes named by `tokenizer.ggml.pre`, as the reference tokenizers define them.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn meta<'a>(c: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value, ModelError> {
    c.metadata
        .get(key)
        .ok_or_else(|| ModelError::Format(format!("GGUF metadata has no {key}")))
}

fn strings(v: &gguf_file::Value) -> Result<Vec<String>, ModelError> {
    v.to_vec()?
        .iter()
        .map(|x| x.to_string().cloned().map_err(ModelError::from))
        .collect()
}

/// The tokenizer of a GGUF file, read from its metadata alone.
pub fn from_gguf_file(path: &std::path::Path) -> Result<Tokenizer, ModelError> {
    let mut f = std::fs::File::open(path).map_err(|e| ModelError::Io(path.into(), e))?;
    let c = gguf_file::Content::read(&mut f)
        .map_err(|e| ModelError::Format(format!("{}: {e}", path.display())))?;
    from_gguf(&c)
}

pub fn from_gguf(c: &gguf_file::Content) -> Result<Tokenizer, ModelError> {
    let model = meta(c, "tokenizer.ggml.model")?.to_string()?.clone();
    let tokens = strings(meta(c, "tokenizer.ggml.tokens")?)?;
    let types: Vec<i32> = match c.metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()?
            .iter()
            .map(|x| x.to_i32())
            .collect::<Result<_, _>>()?,
        None => vec![1; tokens.len()],
    };
    let mut tok = match model.as_str() {
        "gpt2" => byte_level_bpe(c, &tokens)?,
        "llama" => sentencepiece_bpe(c, &tokens, &types)?,
        other => {
            return Err(ModelError::Format(format!(
                "GGUF tokenizer model {other:?} is not supported (byte-level BPE \"gpt2\" and \
                 SentencePiece \"llama\" are); use an HF folder with tokenizer.json for this model"
            )))
        }
    };
    // Both kinds are matched whole in input text; control tokens are special (left out when
    // decoding with special tokens skipped), user-defined ones are text (Gemma's runs of
    // spaces and newlines, say) and must come out of the detokenizer.
    let added = |kind: i32, special: bool| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == kind)
            .map(|(s, _)| AddedToken::from(s.clone(), special).normalized(false))
            .collect()
    };
    let err = |e: tokenizers::Error| ModelError::Tokenizer(e.to_string());
    tok.add_special_tokens(added(TOKEN_TYPE_CONTROL, true))
        .map_err(err)?;
    tok.add_tokens(added(TOKEN_TYPE_USER_DEFINED, false))
        .map_err(err)?;
    Ok(tok)
}

fn vocab(tokens: &[String]) -> Vocab {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect()
}

fn byte_level_bpe(c: &gguf_file::Content, tokens: &[String]) -> Result<Tokenizer, ModelError> {
    let merges = strings(meta(c, "tokenizer.ggml.merges")?)?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| ModelError::Format(format!("malformed merge {m:?}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let pre = c
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok().cloned())
        .unwrap_or_else(|| "default".into());
    // Llama 3 takes a pre-token that is itself in the vocabulary whole, before any merge
    // (HF `ignore_merges`; llama.cpp does the same for this pre-tokenizer).
    let ignore_merges = matches!(pre.as_str(), "llama3" | "llama-v3" | "llama-bpe");
    let bpe = BPE::builder()
        .vocab_and_merges(vocab(tokens), merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tokenizer(&pre)?));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tok)
}

/// SentencePiece BPE as llama.cpp runs it: spaces become U+2581 (one is prepended to each run
/// of text when `add_space_prefix`), then adjacent pieces merge while their concatenation is
/// in the vocabulary, highest score first; characters no piece covers fall back to `<0xXX>`
/// byte tokens. Expressed as a BPE whose merges are every split of every mergeable piece,
/// ranked by the piece's score.
fn sentencepiece_bpe(
    c: &gguf_file::Content,
    tokens: &[String],
    types: &[i32],
) -> Result<Tokenizer, ModelError> {
    let scores: Vec<f32> = meta(c, "tokenizer.ggml.scores")?
        .to_vec()?
        .iter()
        .map(|v| v.to_f32())
        .collect::<Result<_, _>>()?;
    if scores.len() != tokens.len() {
        return Err(ModelError::Format(
            "tokenizer.ggml.scores and tokens differ in length".into(),
        ));
    }
    let add_space_prefix = c
        .metadata
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(true);
    let vocab = vocab(tokens);
    let mut ranked: Vec<(f32, u32, String, String)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        let t = types.get(id).copied().unwrap_or(1);
        if t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_BYTE {
            continue;
        }
        for (i, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(i);
            if vocab.contains_key(l) && vocab.contains_key(r) {
                ranked.push((scores[id], id as u32, l.to_string(), r.to_string()));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let merges = ranked.into_iter().map(|(_, _, l, r)| (l, r)).collect();
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = c
        .metadata
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(|v| v.to_u32().ok())
        .and_then(|i| tokens.get(i as usize))
    {
        bpe = bpe.unk_token(unk.clone());
    }
    let bpe = bpe
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    let err = |e: tokenizers::Error| ModelError::Tokenizer(e.to_string());
    let space = NormalizerWrapper::from(Replace::new(" ", SPM_SPACE.to_string()).map_err(err)?);
    let norm = match add_space_prefix {
        true => NormSequence::new(vec![Prepend::new(SPM_SPACE.to_string()).into(), space]),
        false => NormSequence::new(vec![space]),
    };
    tok.with_normalizer(Some(norm)).map_err(err)?;
    tok.with_decoder(Some(DecoderSequence::new(vec![
        Replace::new(SPM_SPACE.to_string(), " ")
            .map_err(err)?
            .into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
        Strip::new(' ', usize::from(add_space_prefix), 0).into(),
    ])));
    Ok(tok)
}

fn pre_tokenizer(name: &str) -> Result<Sequence, ModelError> {
    let byte_level = |regex| PreTokenizerWrapper::from(ByteLevel::new(false, true, regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper, ModelError> {
        Ok(Split::new(
            SplitPattern::Regex(re.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?
        .into())
    };
    let steps = match name {
        "smollm" => vec![Digits::new(true).into(), byte_level(true)],
        "llama3" | "llama-v3" | "llama-bpe" => vec![split(LLAMA3_SPLIT)?, byte_level(false)],
        "qwen2" | "deepseek-r1-qwen" => vec![split(QWEN2_SPLIT)?, byte_level(false)],
        "default" | "gpt-2" | "gpt2" => vec![byte_level(true)],
        other => {
            return Err(ModelError::Format(format!(
                "GGUF pre-tokenizer {other:?} is not supported (smollm, llama-bpe, qwen2 and \
                 gpt-2 are); use an HF folder with tokenizer.json for this model"
            )))
        }
    };
    Ok(Sequence::new(steps))
}

/// The raw bytes a token stands for. Byte-level BPE vocabularies spell bytes as printable
/// characters (GPT-2's `bytes_to_unicode`); a token may hold part of a UTF-8 character, so
/// decoding it alone would give U+FFFD instead of its bytes. A character outside that table
/// (an added token written as plain text, `tokenizer.json`'s kind) stands for itself, as the
/// byte-level decoder takes it.
pub fn token_bytes(tok: &Tokenizer, id: u32) -> Vec<u8> {
    let byte_level = matches!(
        tok.get_decoder(),
        Some(tokenizers::DecoderWrapper::ByteLevel(_))
    );
    let special = |raw: &str| tok.get_added_vocabulary().is_special_token(raw);
    match tok.id_to_token(id) {
        Some(raw) if byte_level && !special(&raw) => {
            let mut out = Vec::with_capacity(raw.len());
            for c in raw.chars() {
                match byte_of_char(c) {
                    Some(b) => out.push(b),
                    None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            out
        }
        // SentencePiece: `<0xXX>` is one byte; U+2581 is a space.
        Some(raw) if !byte_level && !special(&raw) => spm_byte(&raw)
            .map(|b| vec![b])
            .unwrap_or_else(|| raw.replace(SPM_SPACE, " ").into_bytes()),
        _ => tok.decode(&[id], false).unwrap_or_default().into_bytes(),
    }
}

fn spm_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// Inverse of GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the other 68
/// byte values are spelled with code points from U+0100 on, in byte order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let cp = c as u32;
    if printable(cp) {
        return Some(cp as u8);
    }
    let n = cp.checked_sub(256)?;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_characters_map_back_to_bytes() {
        assert_eq!(byte_of_char('a'), Some(b'a'));
        assert_eq!(byte_of_char('Ġ'), Some(b' '));
        assert_eq!(byte_of_char('Ċ'), Some(b'\n'));
        assert_eq!(
            byte_of_char('Ã'),
            Some(0xC3),
            "printable Latin-1 stands for itself"
        );
        assert_eq!(byte_of_char('ł'), Some(0xA0));
        assert_eq!(
            byte_of_char('Ń'),
            Some(0xAD),
            "the last spelled byte (soft hyphen)"
        );
        assert_eq!(byte_of_char('\u{0100}'), Some(0x00));
        assert_eq!(byte_of_char('中'), None);
    }

    #[test]
    fn pre_tokenizers_build_for_every_known_name() {
        for name in ["smollm", "llama3", "qwen2", "default"] {
            pre_tokenizer(name).unwrap();
        }
        assert!(pre_tokenizer("something-else").is_err());
    }
}
