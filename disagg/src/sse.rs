//! Reading server-sent events from a byte stream (the clients in this binary).

/// Takes the next complete event out of `buf` and returns its `data:` payload (events
/// without one are dropped); `None` until a complete event is buffered.
pub fn next_data(buf: &mut Vec<u8>) -> Option<String> {
    while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
        let ev: Vec<u8> = buf.drain(..end + 2).collect();
        if let Some(data) = String::from_utf8_lossy(&ev).trim().strip_prefix("data: ") {
            return Some(data.to_string());
        }
    }
    None
}
