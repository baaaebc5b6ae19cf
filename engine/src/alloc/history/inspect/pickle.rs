//! A pickle writer for the values a PyTorch memory snapshot holds.
//!
//! PyTorch's `_dump_snapshot` is `pickle.dump` of plain dicts, lists, tuples, strings,
//! integers, floats, booleans and `None`; its web viewer reads protocols 2 to 4 with a small
//! set of opcodes and no memo. This writer emits exactly that set (protocol 2): `PROTO`,
//! `EMPTY_DICT`/`MARK`/`SETITEMS`, `EMPTY_LIST`/`MARK`/`APPENDS`, `TUPLE2`/`MARK`/`TUPLE`,
//! `BINUNICODE`, `BININT1`/`BININT2`/`BININT`/`LONG1`, `BINFLOAT`, `NEWTRUE`/`NEWFALSE` and
//! `STOP` (a snapshot holds no `None`).

/// A Python value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Py {
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<Py>),
    Tuple(Vec<Py>),
    /// Keys in insertion order (Python dicts keep it).
    Dict(Vec<(String, Py)>),
}

impl Py {
    pub fn str(text: impl Into<String>) -> Py {
        Py::Str(text.into())
    }

    pub fn int(value: impl Into<i128>) -> Py {
        Py::Int(value.into())
    }

    /// A dict from `(key, value)` pairs.
    pub fn dict<const N: usize>(entries: [(&str, Py); N]) -> Py {
        Py::Dict(
            entries
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
        )
    }
}

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE2: u8 = 0x86;

/// Python's batch size for `APPENDS` and `SETITEMS`.
const BATCH: usize = 1000;

/// `value` pickled (protocol 2).
pub(crate) fn to_pickle(value: &Py) -> Vec<u8> {
    let mut out = vec![PROTO, 2];
    write(&mut out, value);
    out.push(STOP);
    out
}

fn write(out: &mut Vec<u8>, value: &Py) {
    match value {
        Py::Bool(true) => out.push(NEWTRUE),
        Py::Bool(false) => out.push(NEWFALSE),
        Py::Int(n) => write_int(out, *n),
        Py::Float(x) => {
            out.push(BINFLOAT);
            out.extend_from_slice(&x.to_be_bytes());
        }
        Py::Str(s) => write_str(out, s),
        Py::List(items) => {
            out.push(EMPTY_LIST);
            for chunk in items.chunks(BATCH) {
                out.push(MARK);
                chunk.iter().for_each(|item| write(out, item));
                out.push(APPENDS);
            }
        }
        Py::Tuple(items) if items.len() == 2 => {
            items.iter().for_each(|item| write(out, item));
            out.push(TUPLE2);
        }
        Py::Tuple(items) => {
            out.push(MARK);
            items.iter().for_each(|item| write(out, item));
            out.push(TUPLE);
        }
        Py::Dict(entries) => {
            out.push(EMPTY_DICT);
            for chunk in entries.chunks(BATCH) {
                out.push(MARK);
                for (key, item) in chunk {
                    write_str(out, key);
                    write(out, item);
                }
                out.push(SETITEMS);
            }
        }
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(BINUNICODE);
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_int(out: &mut Vec<u8>, n: i128) {
    if (0..0x100).contains(&n) {
        out.extend_from_slice(&[BININT1, n as u8]);
    } else if (0..0x1_0000).contains(&n) {
        out.push(BININT2);
        out.extend_from_slice(&(n as u16).to_le_bytes());
    } else if (i32::MIN as i128..=i32::MAX as i128).contains(&n) {
        out.push(BININT);
        out.extend_from_slice(&(n as i32).to_le_bytes());
    } else {
        // Two's complement, little-endian, as few bytes as keep the sign.
        let bytes = n.to_le_bytes();
        let mut len = bytes.len();
        while len > 1 {
            let (top, next) = (bytes[len - 1], bytes[len - 2]);
            let redundant = (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0);
            if !redundant {
                break;
            }
            len -= 1;
        }
        out.extend_from_slice(&[LONG1, len as u8]);
        out.extend_from_slice(&bytes[..len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_take_the_smallest_opcode_and_long1_keeps_the_sign() {
        let body = |n: i128| {
            let p = to_pickle(&Py::Int(n));
            p[2..p.len() - 1].to_vec()
        };
        assert_eq!(body(7), vec![BININT1, 7]);
        assert_eq!(body(300), vec![BININT2, 0x2c, 0x01]);
        assert_eq!(body(-1), vec![BININT, 0xff, 0xff, 0xff, 0xff]);
        // 2^31 needs a fifth byte so that the top bit is not read as a sign.
        assert_eq!(body(1 << 31), vec![LONG1, 5, 0, 0, 0, 0x80, 0]);
        assert_eq!(body(u64::MAX as i128).len(), 2 + 9);
        assert_eq!(body(-(1 << 40)), vec![LONG1, 6, 0, 0, 0, 0, 0, 0xff]);
    }

    #[test]
    fn containers_use_mark_and_batches() {
        let value = Py::dict([
            ("a", Py::List(vec![Py::Bool(false), Py::Bool(true)])),
            ("t", Py::Tuple(vec![Py::int(0), Py::int(0)])),
        ]);
        let p = to_pickle(&value);
        assert_eq!(&p[..3], &[PROTO, 2, EMPTY_DICT]);
        assert_eq!(p.last(), Some(&STOP));
        let long = to_pickle(&Py::List(vec![Py::Bool(true); 2500]));
        assert_eq!(long.iter().filter(|&&b| b == APPENDS).count(), 3);
    }
}
