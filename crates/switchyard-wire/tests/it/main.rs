//! The wire formats' integration tests, in one test binary (`it`).

mod captured;
mod golden_payloads;
mod made;
