//! A GGUF header read into candle's metadata values, after `gguf::scan` has checked every length
//! and count against the file: for files candle's own reader refuses (it knows no GGML I32
//! tensor, which DeepSeek-V4's hash layers use), so the tokenizer, the chat template and the
//! configuration of any architecture come from one reader.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{
    Content, TensorInfo as CandleTensor, Value, VersionedMagic,
};
use candle_core::quantized::GgmlDType;

/// A tensor's name, `ne` (fastest first), GGML type and offset in the data section.
pub(crate) type TensorInfo = (String, Vec<usize>, u32, u64);

/// The metadata, the tensor infos, where the data section starts and the alignment of every
/// tensor's data in it.
pub(crate) struct Header {
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub data_start: usize,
    pub align: u64,
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    /// The next `n` bytes (the scan has checked they exist; a short buffer is still an error).
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| format!("truncated at byte {}", self.pos))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.arr()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.arr()?))
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.u64()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }

    fn value(&mut self, ty: u32) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.arr::<1>()?[0]),
            1 => Value::I8(self.arr::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.arr()?)),
            3 => Value::I16(i16::from_le_bytes(self.arr()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(self.u32()? as i32),
            6 => Value::F32(f32::from_bits(self.u32()?)),
            7 => Value::Bool(self.arr::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                let et = self.u32()?;
                let n = self.u64()?;
                // The scan bounded every array (and all of them together).
                let mut v = Vec::with_capacity((n as usize).min(1 << 16));
                for _ in 0..n {
                    v.push(self.value(et)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            t => return Err(format!("metadata value type {t}")),
        })
    }
}

/// Parses a header (GGUF v2 or later) from `b`, which holds at least the header.
pub(crate) fn parse(b: &[u8]) -> Result<Header, String> {
    let mut r = Reader { b, pos: 4 };
    let version = r.u32()?;
    if version < 2 {
        return Err(format!("GGUF version {version}: 2 or later"));
    }
    let (n_tensors, n_kv) = (r.u64()?, r.u64()?);
    let mut metadata = HashMap::new();
    for _ in 0..n_kv {
        let k = r.string()?;
        let ty = r.u32()?;
        let v = r.value(ty)?;
        if metadata.insert(k.clone(), v).is_some() {
            return Err(format!("metadata key `{k}` appears twice"));
        }
    }
    let mut tensors = Vec::new();
    let mut names = std::collections::HashSet::new();
    for _ in 0..n_tensors {
        let name = r.string()?;
        if !names.insert(name.clone()) {
            return Err(format!("tensor `{name}` appears twice"));
        }
        let nd = r.u32()? as usize;
        let mut ne = Vec::with_capacity(nd.min(4));
        for _ in 0..nd {
            ne.push(r.u64()? as usize);
        }
        let ty = r.u32()?;
        tensors.push((name, ne, ty, r.u64()?));
    }
    // As llama.cpp reads it: a u32 power of two, 32 when absent.
    let align = match metadata.get("general.alignment") {
        None => 32,
        Some(Value::U32(a)) if a.is_power_of_two() => *a as usize,
        Some(Value::U32(a)) => return Err(format!("general.alignment {a}: not a power of two")),
        Some(_) => return Err("general.alignment is not a u32".into()),
    };
    Ok(Header {
        metadata,
        tensors,
        data_start: r.pos.div_ceil(align) * align,
        align: align as u64,
    })
}

/// Reads and parses the header of the file at `path` alone (at most as long as the file).
pub(crate) fn read(path: &std::path::Path) -> Result<Header, crate::ModelError> {
    read_with_file(path).map(|(h, _, _)| h)
}

/// [`read`], and the open file with its length (for reading tensors after the header).
pub(crate) fn read_with_file(
    path: &std::path::Path,
) -> Result<(Header, std::io::BufReader<std::fs::File>, u64), crate::ModelError> {
    use std::io::{Read, Seek};
    let p = path.display().to_string();
    let not_gguf = |reason: String| crate::ModelError::NotGguf {
        path: p.clone(),
        reason,
    };
    let open_err = |e: std::io::Error| crate::ModelError::Open {
        path: p.clone(),
        reason: e.to_string(),
    };
    let f = crate::gguf::open_regular(path).map_err(open_err)?;
    let len = f.metadata().map_err(open_err)?.len();
    let mut f = std::io::BufReader::new(f);
    let end = crate::gguf::scan::scan(&mut f, len).map_err(not_gguf)?;
    let mut b = vec![0u8; end as usize];
    f.seek(std::io::SeekFrom::Start(0)).map_err(open_err)?;
    f.read_exact(&mut b).map_err(open_err)?;
    Ok((parse(&b).map_err(not_gguf)?, f, len))
}

/// GGML's tensor type numbers for the formats candle reads.
const GGML_TYPES: [(u32, GgmlDType); 15] = [
    (0, GgmlDType::F32),
    (1, GgmlDType::F16),
    (2, GgmlDType::Q4_0),
    (3, GgmlDType::Q4_1),
    (6, GgmlDType::Q5_0),
    (7, GgmlDType::Q5_1),
    (8, GgmlDType::Q8_0),
    (9, GgmlDType::Q8_1),
    (10, GgmlDType::Q2K),
    (11, GgmlDType::Q3K),
    (12, GgmlDType::Q4K),
    (13, GgmlDType::Q5K),
    (14, GgmlDType::Q6K),
    (15, GgmlDType::Q8K),
    (30, GgmlDType::BF16),
];

impl Header {
    /// The header as candle's reader would have returned it (tensor shapes slowest
    /// dimension first), for reading tensors through candle: a tensor of a type candle does
    /// not know is an error naming it.
    pub(crate) fn into_content(self) -> Result<Content, String> {
        let mut tensor_infos = HashMap::with_capacity(self.tensors.len());
        for (name, mut ne, ty, offset) in self.tensors {
            let Some(&(_, ggml_dtype)) = GGML_TYPES.iter().find(|(t, _)| *t == ty) else {
                return Err(format!(
                    "tensor `{name}` has GGML type {ty}, which is not read here"
                ));
            };
            ne.reverse();
            let info = CandleTensor {
                ggml_dtype,
                shape: candle_core::Shape::from(ne),
                offset,
            };
            tensor_infos.insert(name, info);
        }
        Ok(Content {
            magic: VersionedMagic::GgufV3,
            metadata: self.metadata,
            tensor_infos,
            tensor_data_offset: self.data_start as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header of no tensor and one metadata entry, `general.alignment` of type `ty` and
    /// value `v`.
    fn with_alignment(ty: u32, v: u32) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        let k = b"general.alignment";
        b.extend((k.len() as u64).to_le_bytes());
        b.extend(k);
        b.extend(ty.to_le_bytes());
        b.extend(v.to_le_bytes());
        b
    }

    /// The alignment is a u32 power of two, as llama.cpp reads it: 0 (a division by zero in
    /// candle's reader), 3 (every tensor read shifted) or another type is refused.
    #[test]
    fn the_alignment_is_a_u32_power_of_two() {
        assert_eq!(parse(&with_alignment(4, 64)).unwrap().align, 64);
        for (ty, v, want) in [
            (4, 0, "general.alignment 0: not a power of two"),
            (4, 3, "general.alignment 3: not a power of two"),
            (5, 32, "general.alignment is not a u32"),
        ] {
            let e = parse(&with_alignment(ty, v)).err().expect("refused");
            assert_eq!(e, want);
        }
    }
}
