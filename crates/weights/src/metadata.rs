//! Key/value metadata of a weight file, with typed getters whose errors name the key.

use std::collections::BTreeMap;

use crate::{Result, WeightsError};

#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Any non-negative integer, whatever width the writer chose.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            MetaValue::U8(_)
            | MetaValue::I8(_)
            | MetaValue::U16(_)
            | MetaValue::I16(_)
            | MetaValue::U32(_)
            | MetaValue::I32(_)
            | MetaValue::U64(_)
            | MetaValue::I64(_) => "integer",
            MetaValue::F32(_) | MetaValue::F64(_) => "float",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Metadata {
    entries: BTreeMap<String, MetaValue>,
}

impl Metadata {
    pub fn new(entries: BTreeMap<String, MetaValue>) -> Self {
        Self { entries }
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.entries.get(key)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    pub fn insert(&mut self, key: impl Into<String>, value: MetaValue) {
        self.entries.insert(key.into(), value);
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &MetaValue)> {
        self.entries.iter()
    }

    fn require(&self, key: &str) -> Result<&MetaValue> {
        self.entries
            .get(key)
            .ok_or_else(|| WeightsError::MissingMetadata {
                key: key.to_string(),
            })
    }

    fn wrong(key: &str, expected: &'static str, v: &MetaValue) -> WeightsError {
        WeightsError::WrongMetadataType {
            key: key.to_string(),
            expected,
            found: v.kind(),
        }
    }

    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.require(key)?;
        v.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| Self::wrong(key, "non-negative integer", v))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, "number", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::wrong(key, "bool", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, "string", v))
    }

    /// Optional variants: absent is `Ok(None)`, present with the wrong type is an error.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.entries
            .get(key)
            .map(|_| self.get_usize(key))
            .transpose()
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.entries.get(key).map(|_| self.get_f64(key)).transpose()
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.entries
            .get(key)
            .map(|_| self.get_bool(key))
            .transpose()
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.entries.get(key).map(|_| self.get_str(key)).transpose()
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        let arr = v
            .as_array()
            .ok_or_else(|| Self::wrong(key, "array of strings", v))?;
        arr.iter()
            .map(|x| {
                x.as_str()
                    .ok_or_else(|| Self::wrong(key, "array of strings", x))
            })
            .collect()
    }

    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        let v = self.require(key)?;
        let arr = v
            .as_array()
            .ok_or_else(|| Self::wrong(key, "array of numbers", v))?;
        arr.iter()
            .map(|x| {
                x.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| Self::wrong(key, "array of numbers", x))
            })
            .collect()
    }

    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>> {
        let v = self.require(key)?;
        let arr = v
            .as_array()
            .ok_or_else(|| Self::wrong(key, "array of integers", v))?;
        arr.iter()
            .map(|x| {
                x.as_i64()
                    .ok_or_else(|| Self::wrong(key, "array of integers", x))
            })
            .collect()
    }
}
