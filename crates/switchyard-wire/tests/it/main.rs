//! The wire formats' integration tests, in one test binary (`it`).

mod golden_payloads;
