//! Active sequences.
