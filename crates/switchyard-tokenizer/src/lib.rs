//! A real tokenizer for Switchyard: a Hugging Face `tokenizer.json` and the
//! chat template of its `tokenizer_config.json`.
//!
//! - [`Tokenizer::encode`] turns text into token ids (the `tokenizers` crate,
//!   pure Rust with `fancy-regex`; no C build).
//! - [`Tokenizer::apply_chat_template`] renders OpenAI-style messages with the
//!   model's Jinja template (`minijinja` plus `minijinja-contrib`'s Python
//!   method compatibility, which templates rely on for `.startswith`,
//!   `.split`, `.strip` and friends).
//!
//! The router and the simulated engine share this crate so that both hash
//! the same token ids for the same prompt. The repository bundles the Qwen3
//! tokenizer under `data/tokenizers/` ([`Tokenizer::bundled_dir`]).

#![warn(missing_docs)]

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// File name of the bundled vocabulary.
pub const BUNDLED_TOKENIZER: &str = "qwen3-tokenizer.json";
/// File name of the bundled tokenizer config (chat template).
pub const BUNDLED_CONFIG: &str = "qwen3-tokenizer_config.json";

/// One chat message. Contents never leave the request path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// Loading or using the tokenizer failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read or parsed.
    #[error("loading {path}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The config has no chat template.
    #[error("the tokenizer config has no chat_template")]
    NoChatTemplate,
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Codec(String),
    /// The chat template failed to render (bad messages, usually).
    #[error("chat template: {0}")]
    Template(String),
}

/// A tokenizer with its chat template. Cheap to share behind an `Arc`;
/// every method takes `&self`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    env: minijinja::Environment<'static>,
    has_template: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("has_template", &self.has_template)
            .finish()
    }
}

#[derive(Deserialize)]
struct TokenizerConfig {
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Where the bundled tokenizer lives: `$SWITCHYARD_TOKENIZER_DIR`, else
    /// `$SWITCHYARD_DATA/tokenizers`, else `data/tokenizers` under the working
    /// directory when it holds the files, else the source tree's.
    pub fn bundled_dir() -> PathBuf {
        if let Some(dir) = std::env::var_os("SWITCHYARD_TOKENIZER_DIR") {
            return PathBuf::from(dir);
        }
        if let Some(data) = std::env::var_os("SWITCHYARD_DATA") {
            return PathBuf::from(data).join("tokenizers");
        }
        let local = Path::new("data/tokenizers");
        if local.join(BUNDLED_TOKENIZER).is_file() {
            return local.to_owned();
        }
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/tokenizers")
    }

    /// Loads the bundled Qwen3 tokenizer.
    pub fn bundled() -> Result<Self, TokenizerError> {
        let dir = Self::bundled_dir();
        Self::from_files(
            &dir.join(BUNDLED_TOKENIZER),
            Some(&dir.join(BUNDLED_CONFIG)),
        )
    }

    /// Loads `tokenizer.json` and, when given, the chat template of
    /// `tokenizer_config.json`.
    pub fn from_files(
        tokenizer_json: &Path,
        config_json: Option<&Path>,
    ) -> Result<Self, TokenizerError> {
        let inner =
            tokenizers::Tokenizer::from_file(tokenizer_json).map_err(|e| TokenizerError::Load {
                path: tokenizer_json.to_owned(),
                reason: e.to_string(),
            })?;
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let mut has_template = false;
        if let Some(path) = config_json {
            let load = |reason: String| TokenizerError::Load {
                path: path.to_owned(),
                reason,
            };
            let text = std::fs::read_to_string(path).map_err(|e| load(e.to_string()))?;
            let config: TokenizerConfig =
                serde_json::from_str(&text).map_err(|e| load(e.to_string()))?;
            let template = config.chat_template.ok_or(TokenizerError::NoChatTemplate)?;
            env.add_template_owned("chat", template)
                .map_err(|e| TokenizerError::Template(e.to_string()))?;
            has_template = true;
        }
        Ok(Self {
            inner,
            env,
            has_template,
        })
    }

    /// Token ids of `text`. Special tokens written in the text (such as
    /// `<|im_start|>`) map to their ids; no BOS is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// Renders `messages` with the chat template, ending with the assistant
    /// turn's opening when `add_generation_prompt`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        if !self.has_template {
            return Err(TokenizerError::NoChatTemplate);
        }
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                tools => minijinja::Value::from(()),
            })
            .map_err(|e| TokenizerError::Template(e.to_string()))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    fn tokenizer() -> &'static Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(|| Tokenizer::bundled().expect("bundled tokenizer loads"))
    }

    #[test]
    fn the_bundled_vocabulary_has_qwen3s_size() {
        assert_eq!(tokenizer().vocab_size(), 151_669);
    }

    #[test]
    fn text_round_trips_through_encode_and_decode() {
        let t = tokenizer();
        let ids = t
            .encode("Hello, world! Switchyard routes requests.")
            .unwrap();
        assert!(!ids.is_empty());
        assert_eq!(
            t.decode(&ids).unwrap(),
            "Hello, world! Switchyard routes requests."
        );
    }

    #[test]
    fn special_tokens_in_text_map_to_their_ids() {
        let ids = tokenizer().encode("<|im_start|>user").unwrap();
        assert_eq!(ids[0], 151_644);
    }

    #[test]
    fn the_chat_template_renders_system_user_and_generation_prompt() {
        let messages = vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
        ];
        let text = tokenizer().apply_chat_template(&messages, true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn assistant_turns_with_thinking_use_python_string_methods() {
        let messages = vec![
            ChatMessage {
                role: "user".into(),
                content: "Q".into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: "<think>\nhmm\n</think>\n\nA".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Q2".into(),
            },
        ];
        let text = tokenizer().apply_chat_template(&messages, false).unwrap();
        assert!(
            text.contains("<|im_start|>assistant\nA<|im_end|>"),
            "{text}"
        );
    }

    #[test]
    fn a_missing_file_is_a_load_error() {
        let err =
            Tokenizer::from_files(Path::new("/nonexistent/tokenizer.json"), None).unwrap_err();
        assert!(matches!(err, TokenizerError::Load { .. }));
    }
}
