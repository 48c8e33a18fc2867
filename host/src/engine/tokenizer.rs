//! Tokenizers: from `tokenizer.json`, or rebuilt in Rust from a GGUF file's `tokenizer.ggml.*`
//! metadata (byte-level BPE: vocab, merges, pre-tokenizer, special tokens).

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::ModelError;

/// GGUF token types (llama.cpp `llama_token_type`): control and user-defined tokens are matched
/// whole in input text, never split by BPE.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

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
    if model != "gpt2" {
        return Err(ModelError::Format(format!(
            "GGUF tokenizer model {model:?} is not supported yet (byte-level BPE \"gpt2\" is); \
             use an HF folder with tokenizer.json for this model"
        )));
    }
    let tokens = strings(meta(c, "tokenizer.ggml.tokens")?)?;
    let merges = strings(meta(c, "tokenizer.ggml.merges")?)?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| ModelError::Format(format!("malformed merge {m:?}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let types: Vec<i32> = match c.metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()?
            .iter()
            .map(|x| x.to_i32())
            .collect::<Result<_, _>>()?,
        None => vec![1; tokens.len()],
    };
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    let pre = c
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok().cloned())
        .unwrap_or_else(|| "default".into());
    tok.with_pre_tokenizer(Some(pre_tokenizer(&pre)?));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
        .map(|(s, _)| AddedToken::from(s.clone(), true))
        .collect();
    tok.add_special_tokens(specials)
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
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
            tracing::warn!(
                pre = other,
                "unknown GGUF pre-tokenizer; using the GPT-2 split"
            );
            vec![byte_level(true)]
        }
    };
    Ok(Sequence::new(steps))
}

/// The raw bytes a token stands for. Byte-level BPE vocabularies spell bytes as printable
/// characters (GPT-2's `bytes_to_unicode`); a token may hold part of a UTF-8 character, so
/// decoding it alone would give U+FFFD instead of its bytes.
pub fn token_bytes(tok: &Tokenizer, id: u32) -> Vec<u8> {
    let byte_level = matches!(
        tok.get_decoder(),
        Some(tokenizers::DecoderWrapper::ByteLevel(_))
    );
    match tok.id_to_token(id) {
        Some(raw) if byte_level && !tok.get_added_vocabulary().is_special_token(&raw) => raw
            .chars()
            .map(|c| byte_of_char(c).unwrap_or(b'?'))
            .collect(),
        _ => tok.decode(&[id], false).unwrap_or_default().into_bytes(),
    }
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
        for name in ["smollm", "llama3", "qwen2", "default", "something-else"] {
            pre_tokenizer(name).unwrap();
        }
    }
}
