//! Wiring one device: store, queues, signals, readiness.
