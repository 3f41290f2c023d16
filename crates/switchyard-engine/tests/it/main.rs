//! The simulated engine's integration tests, in one test binary (`it`).

mod scheduler_model;
