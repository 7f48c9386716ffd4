//! The ublk kernel protocol.
