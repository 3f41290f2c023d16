//! What a request asks its workers to generate, and what that costs it:
//! the output flow control expects of it ([`Asked::expected_output_tokens`],
//! its share of the fleet) and the tokens a key's rate limit charges it
//! ([`Asked::token_charge`]). The server reads the ask from the body's
//! count fields, each within its limit ([`Asked::within`]); the simulator
//! knows each request's output and states it as asked.

/// Output tokens flow control assumes for a request that names no output
/// limit.
pub const UNSTATED_OUTPUT_TOKENS: u32 = 256;

/// What a request asks the workers to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Asked {
    /// Sequences generated per prompt: the larger of `n` and `best_of`
    /// (1 when neither is given; 0 is taken as 1).
    pub choices: u32,
    /// Output tokens asked per sequence: the larger of the output fields
    /// given (`None`: neither is).
    pub output_tokens: Option<u32>,
}

impl Default for Asked {
    /// One sequence of whatever length the engine decides.
    fn default() -> Self {
        Self {
            choices: 1,
            output_tokens: None,
        }
    }
}

/// The most a request may ask ([`Asked::within`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AskLimits {
    /// Most sequences per prompt (each of `n`, `best_of`).
    pub choices: u32,
    /// Most output tokens per sequence (each output field).
    pub output_tokens: u64,
}

/// A count past its limit ([`Asked::within`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverAsk {
    /// The field that holds it.
    pub field: &'static str,
    /// Its value.
    pub value: u32,
    /// The limit it passed.
    pub max: u64,
    /// An output field (else a field of sequences per prompt).
    pub output: bool,
}

impl Asked {
    /// The ask of a request whose fields of sequences per prompt
    /// (`choices`: `n`, `best_of`) and output fields (`outputs`:
    /// `max_tokens`, `max_completion_tokens`, ...) hold these counts
    /// (`None`: absent): the larger of each group; or the first count past
    /// its limit, the sequences' fields checked first.
    pub fn within(
        choices: &[(Option<u32>, &'static str)],
        outputs: &[(Option<u32>, &'static str)],
        limits: AskLimits,
    ) -> Result<Asked, OverAsk> {
        let mut asked = Asked::default();
        for &(value, field) in choices {
            let Some(value) = value else { continue };
            if value > limits.choices {
                let max = u64::from(limits.choices);
                return Err(OverAsk {
                    field,
                    value,
                    max,
                    output: false,
                });
            }
            asked.choices = asked.choices.max(value);
        }
        for &(value, field) in outputs {
            let Some(value) = value else { continue };
            if u64::from(value) > limits.output_tokens {
                let max = limits.output_tokens;
                return Err(OverAsk {
                    field,
                    value,
                    max,
                    output: true,
                });
            }
            asked.output_tokens = asked.output_tokens.max(Some(value));
        }
        Ok(asked)
    }

    /// Output tokens the request is expected to generate in all, as flow
    /// control charges it: every sequence's limit, or
    /// [`UNSTATED_OUTPUT_TOKENS`] each when none is given.
    pub fn expected_output_tokens(&self) -> u32 {
        self.choices
            .max(1)
            .saturating_mul(self.output_tokens.unwrap_or(UNSTATED_OUTPUT_TOKENS))
    }

    /// What the request is charged against its key's token limit:
    /// `prompt_tokens` (every prompt of a batch together), plus, for each
    /// of its `prompts`, every sequence's output tokens (`allowance` when
    /// it names no output limit). Saturates instead of overflowing: a
    /// charge that large is refused as larger than any bucket.
    pub fn token_charge(&self, prompt_tokens: u64, prompts: u64, allowance: u32) -> u64 {
        let per_choice = u64::from(self.output_tokens.unwrap_or(allowance));
        let outputs = prompts
            .saturating_mul(u64::from(self.choices.max(1)))
            .saturating_mul(per_choice);
        prompt_tokens.saturating_add(outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(choices: u32, output_tokens: Option<u32>) -> Asked {
        Asked {
            choices,
            output_tokens,
        }
    }

    #[test]
    fn an_ask_is_the_larger_of_each_group_and_a_count_past_its_limit_is_named() {
        let limits = AskLimits {
            choices: 16,
            output_tokens: 1000,
        };
        let ask = Asked::within(
            &[(Some(2), "n"), (Some(4), "best_of")],
            &[
                (Some(100), "max_tokens"),
                (Some(300), "max_completion_tokens"),
            ],
            limits,
        );
        assert_eq!(ask, Ok(asked(4, Some(300))));
        // Nothing given: one sequence of whatever length; n = 0 stays one.
        assert_eq!(
            Asked::within(&[(None, "n")], &[(None, "max_tokens")], limits),
            Ok(Asked::default())
        );
        assert_eq!(
            Asked::within(&[(Some(0), "n")], &[], limits),
            Ok(asked(1, None))
        );
        // At a limit is within it; past it, the field, its value and the limit.
        assert_eq!(
            Asked::within(&[(Some(16), "n")], &[(Some(1000), "max_tokens")], limits),
            Ok(asked(16, Some(1000)))
        );
        assert_eq!(
            Asked::within(&[(Some(1), "n"), (Some(17), "best_of")], &[], limits),
            Err(OverAsk {
                field: "best_of",
                value: 17,
                max: 16,
                output: false
            })
        );
        assert_eq!(
            Asked::within(&[], &[(Some(1001), "max_completion_tokens")], limits),
            Err(OverAsk {
                field: "max_completion_tokens",
                value: 1001,
                max: 1000,
                output: true
            })
        );
        // Both past: the sequences' field is named first.
        assert_eq!(
            Asked::within(&[(Some(99), "n")], &[(Some(5000), "max_tokens")], limits)
                .map_err(|o| o.field),
            Err("n")
        );
    }

    #[test]
    fn a_charge_counts_every_prompt_and_every_choice_and_an_allowance_without_max_tokens() {
        // One prompt of 100 tokens, one choice of up to 50.
        assert_eq!(asked(1, Some(50)).token_charge(100, 1, 1024), 150);
        // n = 4: four choices of 50.
        assert_eq!(asked(4, Some(50)).token_charge(100, 1, 1024), 300);
        // A batch of 3 prompts (300 tokens together), n = 2: 6 choices.
        assert_eq!(asked(2, Some(50)).token_charge(300, 3, 1024), 600);
        // No max_tokens: the allowance per choice.
        assert_eq!(asked(2, None).token_charge(100, 1, 1024), 2148);
        // n = 0 is charged as one choice.
        assert_eq!(asked(0, Some(50)).token_charge(100, 1, 1024), 150);
        assert_eq!(asked(1, None).token_charge(0, 1, 0), 0);
        // The largest asks saturate instead of wrapping.
        assert_eq!(
            asked(u32::MAX, Some(u32::MAX)).token_charge(u64::MAX, u64::MAX, 0),
            u64::MAX
        );
        assert_eq!(
            asked(u32::MAX, Some(u32::MAX)).token_charge(1, u64::MAX / 2, 0),
            u64::MAX
        );
    }

    #[test]
    fn flow_control_expects_every_sequences_limit_or_the_unstated_default() {
        assert_eq!(asked(2, Some(50)).expected_output_tokens(), 100);
        assert_eq!(asked(0, Some(50)).expected_output_tokens(), 50);
        assert_eq!(
            Asked::default().expected_output_tokens(),
            UNSTATED_OUTPUT_TOKENS
        );
        assert_eq!(
            asked(3, None).expected_output_tokens(),
            3 * UNSTATED_OUTPUT_TOKENS
        );
        assert_eq!(
            asked(u32::MAX, Some(u32::MAX)).expected_output_tokens(),
            u32::MAX
        );
    }
}
