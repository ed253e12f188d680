//! `disagg bench transfer`: KV-transfer throughput on loopback against a plain TCP
//! copy of the same bytes, in the same run.
//!
//! One "request" is `tokens` tokens of KV in the embedded model's layout (30 layers,
//! 3 KV heads × 64 dims, f16, blocks of 16): per layer one range of all its blocks,
//! posted as the prefill side would. The receiver verifies every checksum and hands
//! each range to a consumer that drops it. The plain copy writes the same buffers
//! through one TCP connection and reads them into one buffer, no framing or checks.

use std::time::Instant;

use clap::Args;
use kv_transfer::{Fault, KvLayout, KvReceiver, KvSender, XferDesc};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::bench::median;

#[derive(Args, Debug)]
pub struct TransferBenchArgs {
    /// Tokens of KV per transfer.
    #[arg(long, default_value_t = 2048)]
    tokens: usize,
    /// Transfers per measurement round (alternating with the plain copy).
    #[arg(long, default_value_t = 10)]
    repeat: usize,
    #[arg(long)]
    json: bool,
}

const LAYOUT: KvLayout = KvLayout { n_layers: 30, block_size: 16, n_kv_heads: 3, head_dim: 64, dtype_bytes: 2 };

pub fn run(a: TransferBenchArgs) -> anyhow::Result<()> {
    if a.tokens == 0 || a.repeat == 0 {
        anyhow::bail!("--tokens and --repeat must be at least 1");
    }
    let n_blocks = a.tokens.div_ceil(LAYOUT.block_size as usize) as u32;
    let layer: Vec<u8> = (0..n_blocks as usize * LAYOUT.block_bytes()).map(|i| (i * 7 + i / 4096) as u8).collect();
    let total = layer.len() as f64 * LAYOUT.n_layers as f64;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (kv, plain, verify) = rt.block_on(async {
        let rx = KvReceiver::bind("127.0.0.1:0").await?;
        let addr = rx.local_addr().to_string();
        // The plain copy: a listener that reads everything into one buffer.
        let plain_l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let plain_addr = plain_l.local_addr()?;
        let want = layer.len() * LAYOUT.n_layers as usize;
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = plain_l.accept().await else { continue };
                let _ = s.set_nodelay(true);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 1 << 20];
                    let mut got = 0;
                    while got < want {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got += n,
                        }
                    }
                    let _ = s.write_all(&[0]).await;
                });
            }
        });
        let (mut kv, mut plain, mut verify) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.repeat {
            // KV transfer: descriptors, checksums on both sides, a consumer per range.
            let t = Instant::now();
            let mut inbound = rx.expect(LAYOUT, n_blocks);
            let ticket = inbound.ticket;
            let consumer = tokio::spawn(async move {
                let mut n = 0usize;
                while let Some(c) = inbound.recv().await? {
                    n += c.data.len();
                }
                Ok::<_, kv_transfer::TransferError>(n)
            });
            let mut s = KvSender::connect(&addr, ticket, LAYOUT, n_blocks, Fault::None).await?;
            for l in 0..LAYOUT.n_layers {
                s.send(XferDesc { layer: l, first_block: 0, n_blocks }, &layer).await?;
            }
            s.finish().await?;
            let n = consumer.await??;
            anyhow::ensure!(n as f64 == total, "received {n} of {total} bytes");
            kv.push(total / t.elapsed().as_secs_f64());

            // The plain copy of the same bytes.
            let t = Instant::now();
            let mut c = tokio::net::TcpStream::connect(plain_addr).await?;
            c.set_nodelay(true)?;
            for _ in 0..LAYOUT.n_layers {
                c.write_all(&layer).await?;
            }
            let mut ack = [0u8; 1];
            c.read_exact(&mut ack).await?;
            plain.push(total / t.elapsed().as_secs_f64());

            // What the checksum alone costs on this CPU (both ends compute it).
            let t = Instant::now();
            let mut h = crc32fast::Hasher::new();
            for _ in 0..LAYOUT.n_layers {
                h.update(&layer);
            }
            std::hint::black_box(h.finalize());
            verify.push(total / t.elapsed().as_secs_f64());
        }
        Ok::<_, anyhow::Error>((kv, plain, verify))
    })?;
    let (kv, plain, verify) = (median(kv), median(plain), median(verify));
    let out = json!({
        "bench": "transfer",
        "backend": "tcp (loopback)",
        "tokens": a.tokens,
        "layout": LAYOUT.to_string(),
        "bytes_per_transfer": total,
        "repeat": a.repeat,
        "kv_transfer_gb_per_s": kv / 1e9,
        "plain_tcp_gb_per_s": plain / 1e9,
        "kv_over_plain": kv / plain,
        "crc32_gb_per_s": verify / 1e9,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
