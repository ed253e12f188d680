//! KV transfer between workers, in the style of NIXL: the receiver registers where
//! blocks will land and hands out a ticket; the sender posts descriptor-tagged block
//! ranges against that ticket; completion and failure come back on the same channel.
//!
//! This crate has the first backend, TCP (tokio). The shape is the one the UCX and
//! GPU backends will fill:
//! - *registration*: [`KvReceiver::expect`] reserves a ticket for one request's blocks
//!   (with UCX: registered memory and a packed rkey instead of a ticket);
//! - *descriptors*: [`XferDesc`] names a layer and a range of the request's logical
//!   blocks; the payload is the backend-neutral transfer layout of those blocks;
//! - *post*: [`KvSender::send`] posts one descriptor with its bytes;
//! - *poll/notify*: [`Inbound::recv`] yields verified chunks and then completion, or the
//!   error that ended the transfer; [`KvSender::finish`] returns once the receiver has
//!   verified every block.
//!
//! Wire protocol (all integers little-endian), one TCP connection per request:
//! ```text
//! sender → receiver  HELLO   "DKV1" ticket:u64 layout(n_layers, block_size, n_kv_heads,
//!                            head_dim, dtype_bytes):5×u32 n_blocks:u32
//! receiver → sender  STATUS  code:u8 len:u16 message
//! sender → receiver  DATA    1:u8 layer:u32 first_block:u32 n_blocks:u32 crc32:u32 payload
//!                    (payload = n_blocks × block bytes; crc32 over the 12 descriptor
//!                    bytes then the payload)
//!                    END     2:u8
//! receiver → sender  STATUS  (0 once every (layer, block) arrived exactly once)
//! ```
//! A frame is checked before it is handed on; a bad checksum, an overlap, a range
//! outside the reservation, or a connection that closes before END fails the transfer,
//! and nothing of a failed frame reaches the receiver's consumer.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const MAGIC: &[u8; 4] = b"DKV1";
const DATA: u8 = 1;
const END: u8 = 2;

/// What both sides must agree on for blocks to be copied without relayout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: u32,
    pub block_size: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per element (2 for f16, 4 for f32).
    pub dtype_bytes: u32,
}

impl KvLayout {
    /// Bytes of one block of one layer, keys and values.
    pub fn block_bytes(&self) -> usize {
        2 * (self.block_size * self.n_kv_heads * self.head_dim * self.dtype_bytes) as usize
    }
}

impl std::fmt::Display for KvLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers × block {} × {} KV heads × head dim {} × {} B",
            self.n_layers, self.block_size, self.n_kv_heads, self.head_dim, self.dtype_bytes
        )
    }
}

/// One posted range: a layer and consecutive logical blocks of the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XferDesc {
    pub layer: u32,
    pub first_block: u32,
    pub n_blocks: u32,
}

/// A verified range and its bytes, as the receiver hands it on.
#[derive(Debug)]
pub struct Chunk {
    pub desc: XferDesc,
    pub data: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("KV transfer I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("KV transfer refused by the receiver: {0}")]
    Refused(String),
    #[error("KV transfer protocol error: {0}")]
    Protocol(String),
    #[error("KV block range checksum mismatch (layer {layer}, blocks {first}..{end}): data corrupted in transit")]
    Checksum { layer: u32, first: u32, end: u32 },
    #[error("the KV transfer connection closed before the transfer completed")]
    Cut,
}

/// Faults a sender can inject, for tests of the failure paths.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    #[default]
    None,
    /// Flip one payload byte of the second frame after its checksum is computed.
    Corrupt,
    /// Close the connection after the second frame, without END.
    Cut,
}

impl std::str::FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" | "none" => Ok(Fault::None),
            "corrupt" => Ok(Fault::Corrupt),
            "cut" => Ok(Fault::Cut),
            _ => Err(format!("unknown KV transfer fault {s:?}; use none, corrupt or cut")),
        }
    }
}

fn crc(desc: &XferDesc, data: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&desc.layer.to_le_bytes());
    h.update(&desc.first_block.to_le_bytes());
    h.update(&desc.n_blocks.to_le_bytes());
    h.update(data);
    h.finalize()
}

async fn write_status(s: &mut TcpStream, code: u8, msg: &str) -> std::io::Result<()> {
    let m = &msg.as_bytes()[..msg.len().min(u16::MAX as usize)];
    let mut b = Vec::with_capacity(3 + m.len());
    b.push(code);
    b.extend_from_slice(&(m.len() as u16).to_le_bytes());
    b.extend_from_slice(m);
    s.write_all(&b).await
}

async fn read_status(s: &mut TcpStream) -> Result<(), TransferError> {
    let code = s.read_u8().await.map_err(|_| TransferError::Cut)?;
    let len = s.read_u16_le().await.map_err(|_| TransferError::Cut)?;
    let mut m = vec![0u8; len as usize];
    s.read_exact(&mut m).await.map_err(|_| TransferError::Cut)?;
    match code {
        0 => Ok(()),
        _ => Err(TransferError::Refused(String::from_utf8_lossy(&m).into_owned())),
    }
}

struct Expected {
    layout: KvLayout,
    n_blocks: u32,
    tx: mpsc::Sender<Result<Option<Chunk>, TransferError>>,
}

#[derive(Default)]
struct Registry {
    next: AtomicU64,
    expected: Mutex<HashMap<u64, Expected>>,
}

/// The receiving side: a listener that routes incoming transfers to their tickets.
pub struct KvReceiver {
    addr: SocketAddr,
    reg: Arc<Registry>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for KvReceiver {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// One expected transfer (a registered reservation). Dropping it unregisters the
/// ticket; a transfer arriving later is refused.
pub struct Inbound {
    pub ticket: u64,
    rx: mpsc::Receiver<Result<Option<Chunk>, TransferError>>,
    reg: Arc<Registry>,
    done: bool,
}

impl Inbound {
    /// The next verified chunk; `Ok(None)` once every block of every layer arrived.
    pub async fn recv(&mut self) -> Result<Option<Chunk>, TransferError> {
        if self.done {
            return Ok(None);
        }
        let r = self.rx.recv().await.unwrap_or(Err(TransferError::Cut));
        if !matches!(r, Ok(Some(_))) {
            self.done = true;
        }
        r
    }
}

impl Drop for Inbound {
    fn drop(&mut self) {
        self.reg.expected.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.ticket);
    }
}

impl KvReceiver {
    /// Listens on `addr` (port 0 picks one).
    pub async fn bind(addr: &str) -> std::io::Result<KvReceiver> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let reg = Arc::new(Registry { next: AtomicU64::new(1), ..Default::default() });
        let r = reg.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((s, peer)) = listener.accept().await else {
                    // E.g. out of file descriptors: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let r = r.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve_connection(s, &r).await {
                        tracing::warn!(%peer, error = %e, "KV transfer failed");
                    }
                });
            }
        });
        Ok(KvReceiver { addr, reg, accept })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Registers a transfer of `n_blocks` blocks per layer in `layout`.
    pub fn expect(&self, layout: KvLayout, n_blocks: u32) -> Inbound {
        let ticket = self.reg.next.fetch_add(1, Ordering::Relaxed);
        // Room for a few layers in flight; beyond that TCP flow control holds the sender.
        let (tx, rx) = mpsc::channel(8);
        self.reg.expected.lock().unwrap_or_else(|e| e.into_inner()).insert(ticket, Expected { layout, n_blocks, tx });
        Inbound { ticket, rx, reg: self.reg.clone(), done: false }
    }
}

async fn serve_connection(mut s: TcpStream, reg: &Registry) -> Result<(), TransferError> {
    s.set_nodelay(true)?;
    let mut hello = [0u8; 36];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut hello))
        .await
        .map_err(|_| TransferError::Protocol("no HELLO within 10 s".into()))??;
    if &hello[..4] != MAGIC {
        write_status(&mut s, 1, "not a disagg KV transfer (bad magic)").await?;
        return Err(TransferError::Protocol("bad magic".into()));
    }
    let u = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().expect("4 bytes"));
    let ticket = u64::from_le_bytes(hello[4..12].try_into().expect("8 bytes"));
    let layout =
        KvLayout { n_layers: u(12), block_size: u(16), n_kv_heads: u(20), head_dim: u(24), dtype_bytes: u(28) };
    let n_blocks = u(32);
    // Take the registration: one connection per ticket.
    let Some(exp) = reg.expected.lock().unwrap_or_else(|e| e.into_inner()).remove(&ticket) else {
        write_status(&mut s, 1, &format!("unknown or expired ticket {ticket}")).await?;
        return Err(TransferError::Refused(format!("unknown ticket {ticket}")));
    };
    if exp.layout != layout || exp.n_blocks != n_blocks {
        let m = format!(
            "incompatible KV layout: the receiver expects {} blocks of [{}], the sender has {n_blocks} of [{layout}]",
            exp.n_blocks, exp.layout
        );
        write_status(&mut s, 1, &m).await?;
        let _ = exp.tx.send(Err(TransferError::Refused(m.clone()))).await;
        return Err(TransferError::Refused(m));
    }
    write_status(&mut s, 0, "").await?;
    let r = receive_frames(&mut s, &exp).await;
    match r {
        Ok(()) => {
            let _ = exp.tx.send(Ok(None)).await;
            write_status(&mut s, 0, "").await?;
            Ok(())
        }
        Err(e) => {
            let _ = write_status(&mut s, 1, &e.to_string()).await;
            let msg = e.to_string();
            let _ = exp.tx.send(Err(e)).await;
            Err(TransferError::Protocol(msg))
        }
    }
}

async fn receive_frames(s: &mut TcpStream, exp: &Expected) -> Result<(), TransferError> {
    let (layout, n_blocks) = (exp.layout, exp.n_blocks);
    let block_bytes = layout.block_bytes();
    // Per layer, blocks received so far (frames of a layer arrive in block order).
    let mut next = vec![0u32; layout.n_layers as usize];
    loop {
        let kind = s.read_u8().await.map_err(|_| TransferError::Cut)?;
        match kind {
            END => {
                return match next.iter().position(|&n| n != n_blocks) {
                    None => Ok(()),
                    Some(l) => {
                        Err(TransferError::Protocol(format!("END after {} of {n_blocks} blocks of layer {l}", next[l])))
                    }
                };
            }
            DATA => {}
            k => return Err(TransferError::Protocol(format!("unknown frame kind {k}"))),
        }
        let mut h = [0u8; 16];
        s.read_exact(&mut h).await.map_err(|_| TransferError::Cut)?;
        let u = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let desc = XferDesc { layer: u(0), first_block: u(4), n_blocks: u(8) };
        let sum = u(12);
        let l = desc.layer as usize;
        if l >= next.len()
            || desc.first_block != next[l]
            || desc.n_blocks == 0
            || desc.first_block as u64 + desc.n_blocks as u64 > n_blocks as u64
        {
            return Err(TransferError::Protocol(format!(
                "frame for layer {} blocks {}..{} does not continue the transfer ({} layers, {n_blocks} blocks)",
                desc.layer,
                desc.first_block,
                desc.first_block as u64 + desc.n_blocks as u64,
                layout.n_layers
            )));
        }
        // Read straight into the buffer handed on, without zero-filling it first.
        let len = desc.n_blocks as usize * block_bytes;
        let mut data = Vec::with_capacity(len);
        while data.len() < len {
            let want = (len - data.len()) as u64;
            if (&mut *s).take(want).read_buf(&mut data).await.map_err(|_| TransferError::Cut)? == 0 {
                return Err(TransferError::Cut);
            }
        }
        if crc(&desc, &data) != sum {
            return Err(TransferError::Checksum {
                layer: desc.layer,
                first: desc.first_block,
                end: desc.first_block + desc.n_blocks,
            });
        }
        next[l] += desc.n_blocks;
        if exp.tx.send(Ok(Some(Chunk { desc, data }))).await.is_err() {
            return Err(TransferError::Refused("the receiver gave the request up".into()));
        }
    }
}

/// The sending side of one request's transfer.
pub struct KvSender {
    s: TcpStream,
    layout: KvLayout,
    frames: usize,
    bytes: u64,
    fault: Fault,
}

impl KvSender {
    /// Connects to a receiver and presents `ticket`; fails if it is refused (unknown
    /// ticket, other layout or block count).
    pub async fn connect(
        addr: &str,
        ticket: u64,
        layout: KvLayout,
        n_blocks: u32,
        fault: Fault,
    ) -> Result<KvSender, TransferError> {
        let mut s = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr))
            .await
            .map_err(|_| TransferError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")))??;
        s.set_nodelay(true)?;
        let mut hello = Vec::with_capacity(36);
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&ticket.to_le_bytes());
        for v in [layout.n_layers, layout.block_size, layout.n_kv_heads, layout.head_dim, layout.dtype_bytes, n_blocks]
        {
            hello.extend_from_slice(&v.to_le_bytes());
        }
        s.write_all(&hello).await?;
        read_status(&mut s).await?;
        Ok(KvSender { s, layout, frames: 0, bytes: 0, fault })
    }

    /// Posts one block range; `data` is `n_blocks` blocks in the transfer layout, sent
    /// from where it lies (one vectored write with the frame header).
    pub async fn send(&mut self, desc: XferDesc, data: &[u8]) -> Result<(), TransferError> {
        assert_eq!(data.len(), desc.n_blocks as usize * self.layout.block_bytes(), "payload size of {desc:?}");
        let mut head = [0u8; 17];
        head[0] = DATA;
        head[1..5].copy_from_slice(&desc.layer.to_le_bytes());
        head[5..9].copy_from_slice(&desc.first_block.to_le_bytes());
        head[9..13].copy_from_slice(&desc.n_blocks.to_le_bytes());
        head[13..17].copy_from_slice(&crc(&desc, data).to_le_bytes());
        self.frames += 1;
        if self.fault == Fault::Corrupt && self.frames == 2 {
            let mut bad = data.to_vec();
            let mid = bad.len() / 2;
            bad[mid] ^= 0x40;
            return self.write_frame(&head, &bad).await;
        }
        self.write_frame(&head, data).await?;
        if self.fault == Fault::Cut && self.frames == 2 {
            let _ = self.s.shutdown().await;
            return Err(TransferError::Cut);
        }
        Ok(())
    }

    async fn write_frame(&mut self, head: &[u8], data: &[u8]) -> Result<(), TransferError> {
        let (mut h, mut d) = (head, data);
        while !h.is_empty() || !d.is_empty() {
            let n = self.s.write_vectored(&[IoSlice::new(h), IoSlice::new(d)]).await?;
            if n == 0 {
                return Err(TransferError::Cut);
            }
            let from_h = n.min(h.len());
            h = &h[from_h..];
            d = &d[n - from_h..];
        }
        self.bytes += data.len() as u64;
        Ok(())
    }

    /// Ends the transfer and waits until the receiver has verified every block.
    /// Returns the payload bytes sent.
    pub async fn finish(mut self) -> Result<u64, TransferError> {
        self.s.write_all(&[END]).await?;
        read_status(&mut self.s).await?;
        Ok(self.bytes)
    }

    /// Reads the receiver's verdict after a failed send (its reason is more useful
    /// than a broken pipe).
    pub async fn reason(mut self) -> Option<TransferError> {
        match tokio::time::timeout(Duration::from_secs(2), read_status(&mut self.s)).await {
            Ok(Err(e @ TransferError::Refused(_))) => Some(e),
            _ => None,
        }
    }
}
