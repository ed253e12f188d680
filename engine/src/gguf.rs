//! A reader for GGUF files (format versions 2 and 3).
//!
//! Rules this module keeps:
//! - A truncated or corrupt file is an error that says what is wrong, never a panic
//!   or an allocation sized by an untrusted length.
//! - Only the header is read eagerly; tensor data is read on demand with seek + read,
//!   so loading never needs unsafe memory mapping.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use kernels::quant::GgmlType;

use crate::EngineError;

const MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        Some(match *self {
            Value::U8(v) => v as u64,
            Value::U16(v) => v as u64,
            Value::U32(v) => v as u64,
            Value::U64(v) => v,
            Value::I8(v) if v >= 0 => v as u64,
            Value::I16(v) if v >= 0 => v as u64,
            Value::I32(v) if v >= 0 => v as u64,
            Value::I64(v) if v >= 0 => v as u64,
            _ => return None,
        })
    }

    pub fn as_f64(&self) -> Option<f64> {
        Some(match *self {
            Value::F32(v) => v as f64,
            Value::F64(v) => v,
            _ => return self.as_u64().map(|v| v as f64),
        })
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (columns of a matrix).
    pub dims: Vec<u64>,
    pub type_id: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

pub struct Gguf {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data_start: u64,
    file_len: u64,
}

struct Reader<R> {
    r: R,
    pos: u64,
    len: u64,
    path: PathBuf,
}

impl<R: Read> Reader<R> {
    fn err(&self, what: &str) -> EngineError {
        EngineError::Model(format!(
            "{} is not a valid GGUF file: {what} (at byte {}); re-download it or pass another --model",
            self.path.display(),
            self.pos
        ))
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], EngineError> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|_| self.err("unexpected end of file"))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, EngineError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, EngineError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// A length read from the file, checked against what is left of the file.
    fn len(&mut self, elem_bytes: u64) -> Result<usize, EngineError> {
        let n = self.u64()?;
        if n.saturating_mul(elem_bytes) > self.len.saturating_sub(self.pos) {
            return Err(self.err(&format!("a length of {n} runs past the end of the file")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, EngineError> {
        let n = self.len(1)?;
        let mut b = vec![0u8; n];
        self.r.read_exact(&mut b).map_err(|_| self.err("unexpected end of file"))?;
        self.pos += n as u64;
        String::from_utf8(b).map_err(|_| self.err("a string is not valid UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, EngineError> {
        Ok(match ty {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(self.bytes::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => Value::Bool(self.bytes::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.err("arrays nested too deeply"));
                }
                let elem_ty = self.u32()?;
                let n = self.len(1)?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(elem_ty, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(self.err(&format!("unknown metadata value type {other}"))),
        })
    }
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Gguf, EngineError> {
        let file = File::open(path)
            .map_err(|e| EngineError::Model(format!("cannot open model file {}: {e}", path.display())))?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut r = Reader { r: BufReader::with_capacity(1 << 20, file), pos: 0, len, path: path.to_path_buf() };
        if r.u32().map_err(|_| r.err("too short"))? != MAGIC {
            return Err(r.err("bad magic (expected \"GGUF\")"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(r.err(&format!("unsupported GGUF version {version} (supported: 2, 3)")));
        }
        let n_tensors = r.len(8)?;
        let n_kv = r.len(8)?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims == 0 || n_dims > 4 {
                return Err(r.err(&format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
            let type_id = r.u32()?;
            let offset = r.u64()?;
            tensors.push(TensorInfo { name, dims, type_id, offset });
        }
        let alignment = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(32).max(1);
        let data_start = r.pos.div_ceil(alignment) * alignment;
        let g = Gguf { path: path.to_path_buf(), version, metadata, tensors, data_start, file_len: len };
        for t in &g.tensors {
            let end = g.tensor_range(t).map(|(_, e)| e);
            match end {
                Ok(e) if e <= len => {}
                Ok(_) => {
                    return Err(EngineError::Model(format!(
                        "{} is truncated: tensor {} ends past the end of the file; re-download it",
                        path.display(),
                        t.name
                    )))
                }
                Err(_) => {} // unsupported types are reported when the tensor is used
            }
        }
        Ok(g)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn tensor_range(&self, t: &TensorInfo) -> Result<(u64, u64), EngineError> {
        let ty = GgmlType::from_id(t.type_id).map_err(|name| unsupported_type(&t.name, &name))?;
        let n = t.n_elements();
        if !n.is_multiple_of(ty.block_len() as u64) {
            return Err(EngineError::Model(format!("tensor {} has a size that is not whole blocks", t.name)));
        }
        let bytes = n / ty.block_len() as u64 * ty.block_bytes() as u64;
        let start = self.data_start + t.offset;
        Ok((start, start + bytes))
    }

    /// Reads a tensor's raw bytes and its type.
    pub fn read_tensor(&self, t: &TensorInfo) -> Result<(GgmlType, Vec<u8>), EngineError> {
        let ty = GgmlType::from_id(t.type_id).map_err(|name| unsupported_type(&t.name, &name))?;
        let (start, end) = self.tensor_range(t)?;
        if end > self.file_len {
            return Err(EngineError::Model(format!("tensor {} runs past the end of the file", t.name)));
        }
        let mut f = File::open(&self.path)
            .map_err(|e| EngineError::Model(format!("cannot open {}: {e}", self.path.display())))?;
        f.seek(SeekFrom::Start(start)).map_err(|e| EngineError::Model(format!("seek failed: {e}")))?;
        let mut buf = vec![0u8; (end - start) as usize];
        f.read_exact(&mut buf).map_err(|e| EngineError::Model(format!("reading tensor {} failed: {e}", t.name)))?;
        Ok((ty, buf))
    }

    /// Reads a tensor and converts it to f32 values (norm weights and such).
    pub fn read_f32(&self, t: &TensorInfo) -> Result<Vec<f32>, EngineError> {
        let (ty, bytes) = self.read_tensor(t)?;
        let mut out = vec![0f32; t.n_elements() as usize];
        kernels::quant::dequantize_row(ty, &bytes, &mut out);
        Ok(out)
    }
}

fn unsupported_type(tensor: &str, ty: &str) -> EngineError {
    EngineError::Unsupported(format!(
        "tensor {tensor} is stored as {ty}, which this engine cannot compute with; supported types are \
         F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (re-quantize the model, e.g. with llama.cpp's llama-quantize to Q4_1 or Q8_0)"
    ))
}
