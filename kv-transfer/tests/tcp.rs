//! The TCP backend on loopback: data arrives intact and in order; corruption, cuts,
//! wrong layouts and unknown tickets fail the transfer on both sides, and nothing of a
//! bad frame reaches the consumer.

use kv_transfer::{Fault, KvLayout, KvReceiver, KvSender, TransferError, XferDesc};

const LAYOUT: KvLayout = KvLayout { n_layers: 3, block_size: 4, n_kv_heads: 2, head_dim: 8, dtype_bytes: 2 };

fn payload(layer: u32, first: u32, n: u32) -> Vec<u8> {
    let bb = LAYOUT.block_bytes();
    (0..n as usize * bb).map(|i| (i as u32 * 31 + layer * 7 + first * 13) as u8).collect()
}

/// Sends 5 blocks per layer in ranges of 2, 2, 1 (layer by layer); returns the sender's
/// result and everything the receiver handed on.
async fn transfer(fault: Fault) -> (Result<u64, TransferError>, Vec<(XferDesc, Vec<u8>)>, Option<TransferError>) {
    let rx = KvReceiver::bind("127.0.0.1:0").await.unwrap();
    let mut inbound = rx.expect(LAYOUT, 5);
    let addr = rx.local_addr().to_string();
    let ticket = inbound.ticket;
    let sender = tokio::spawn(async move {
        let mut s = KvSender::connect(&addr, ticket, LAYOUT, 5, fault).await?;
        for layer in 0..3 {
            for (first, n) in [(0, 2), (2, 2), (4, 1)] {
                let d = XferDesc { layer, first_block: first, n_blocks: n };
                if let Err(e) = s.send(d, &payload(layer, first, n)).await {
                    return Err(s.reason().await.unwrap_or(e));
                }
            }
        }
        s.finish().await
    });
    let mut got = Vec::new();
    let err = loop {
        match inbound.recv().await {
            Ok(Some(c)) => got.push((c.desc, c.data)),
            Ok(None) => break None,
            Err(e) => break Some(e),
        }
    };
    (sender.await.unwrap(), got, err)
}

#[tokio::test]
async fn blocks_arrive_intact_and_in_order() {
    let (sent, got, err) = transfer(Fault::None).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(sent.unwrap(), 15 * LAYOUT.block_bytes() as u64);
    assert_eq!(got.len(), 9);
    for (d, data) in &got {
        assert_eq!(data, &payload(d.layer, d.first_block, d.n_blocks));
    }
}

#[tokio::test]
async fn a_corrupted_range_is_caught_by_its_checksum_and_never_handed_on() {
    let (sent, got, err) = transfer(Fault::Corrupt).await;
    assert!(matches!(err, Some(TransferError::Checksum { layer: 0, first: 2, end: 4 })), "{err:?}");
    assert_eq!(got.len(), 1, "only the frame before the corrupted one was handed on");
    let e = sent.unwrap_err();
    assert!(e.to_string().contains("checksum"), "the sender learns why: {e}");
}

#[tokio::test]
async fn a_cut_connection_fails_the_transfer() {
    let (sent, got, err) = transfer(Fault::Cut).await;
    assert!(matches!(err, Some(TransferError::Cut)), "{err:?}");
    assert!(got.len() <= 2);
    assert!(sent.is_err());
}

#[tokio::test]
async fn other_layouts_and_unknown_tickets_are_refused() {
    let rx = KvReceiver::bind("127.0.0.1:0").await.unwrap();
    let addr = rx.local_addr().to_string();
    let mut inbound = rx.expect(LAYOUT, 5);
    let other = KvLayout { head_dim: 16, ..LAYOUT };
    let e = KvSender::connect(&addr, inbound.ticket, other, 5, Fault::None).await.err().unwrap();
    assert!(e.to_string().contains("incompatible KV layout"), "{e}");
    assert!(matches!(inbound.recv().await, Err(TransferError::Refused(_))));
    let e = KvSender::connect(&addr, 999, LAYOUT, 5, Fault::None).await.err().unwrap();
    assert!(e.to_string().contains("unknown or expired ticket"), "{e}");
    // A dropped reservation no longer accepts its transfer.
    let inbound = rx.expect(LAYOUT, 1);
    let t = inbound.ticket;
    drop(inbound);
    assert!(KvSender::connect(&addr, t, LAYOUT, 1, Fault::None).await.is_err());
}
