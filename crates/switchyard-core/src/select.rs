//! Selection.
