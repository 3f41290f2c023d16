//! OpenAI API shapes that more than one of our servers parses.

use serde::Deserialize;

/// The `prompt` of a `/v1/completions` request: text, token ids, or a batch
/// of either. Both the router and the simulated worker accept all four.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// A batch of text prompts.
    Texts(Vec<String>),
    /// A batch of token-id prompts.
    TokenBatches(Vec<Vec<u32>>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_prompt_shape_parses() {
        let parse = |s: &str| serde_json::from_str::<Prompt>(s).unwrap();
        assert_eq!(parse("\"hi\""), Prompt::Text("hi".into()));
        assert_eq!(parse("[1, 2]"), Prompt::Tokens(vec![1, 2]));
        assert_eq!(
            parse("[\"a\", \"b\"]"),
            Prompt::Texts(vec!["a".into(), "b".into()])
        );
        assert_eq!(
            parse("[[1], [2, 3]]"),
            Prompt::TokenBatches(vec![vec![1], vec![2, 3]])
        );
        assert!(serde_json::from_str::<Prompt>("{\"x\": 1}").is_err());
    }
}
