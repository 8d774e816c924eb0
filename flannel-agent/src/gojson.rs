//! JSON decoding and encoding with the semantics of Go's `encoding/json`, which upstream flannel
//! uses for `net-conf.json`, backend options, lease values and BackendData.
//!
//! What differs from a plain serde derive:
//!
//! * object keys match struct fields **case-insensitively** (Go folds both sides: ASCII letters
//!   to upper case, other characters through lower-then-upper case), unknown keys are ignored,
//!   and a later duplicate key overrides an earlier one (every occurrence is still decoded, so an
//!   invalid earlier value is an error as in Go);
//! * `null` leaves a scalar field unchanged (callers see `None`);
//! * integers are parsed from the literal text exactly like `strconv.ParseUint/ParseInt`, so
//!   `24.0`, `2.4e1` or `"24"` are not integers;
//! * embedded raw JSON (`json.RawMessage`) is re-emitted compacted with HTML-escaping, like
//!   `json.Marshal` does ([`compact`]), and strings are written the way Go writes them
//!   ([`write_string`]).

use std::fmt;

use serde::Deserializer as _;
use serde::de::{MapAccess, Visitor};
use serde_json::value::RawValue;

/// A decoding error: the JSON is malformed or a field has the wrong type or value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GoJsonError {
    /// The text is not valid JSON.
    #[error("invalid JSON: {0}")]
    Syntax(String),
    /// The top-level value is valid JSON but not an object (or `null`).
    #[error("cannot unmarshal {found} into an object")]
    NotAnObject {
        /// The JSON kind that was found (`array`, `string`, `number`, `bool`).
        found: &'static str,
    },
    /// A field holds a value of the wrong type or an unparsable value.
    #[error("field \"{field}\": cannot use {value} as {expected}")]
    Field {
        /// The field name as the struct spells it (e.g. `SubnetLen`).
        field: String,
        /// The offending JSON text, shortened when long.
        value: String,
        /// What was expected, e.g. `uint`, `bool`, `string`.
        expected: String,
    },
}

impl GoJsonError {
    /// A field error for `raw` (the JSON text of the value).
    pub fn field(field: &str, raw: &RawValue, expected: impl Into<String>) -> Self {
        GoJsonError::Field {
            field: field.to_owned(),
            value: shorten(raw.get()),
            expected: expected.into(),
        }
    }
}

/// Shortens `s` to at most 64 characters for error messages.
fn shorten(s: &str) -> String {
    const MAX: usize = 64;
    if s.chars().count() <= MAX {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(MAX).collect();
        out.push('…');
        out
    }
}

/// The members of one JSON object, in document order, with duplicate keys kept.
#[derive(Debug)]
pub struct GoObject<'a> {
    members: Vec<(String, &'a RawValue)>,
}

impl<'a> GoObject<'a> {
    /// Parses `json` as an object. `Ok(None)` means the document is `null` (Go then leaves the
    /// target struct untouched).
    pub fn parse(json: &'a str) -> Result<Option<Self>, GoJsonError> {
        let raw: &RawValue =
            serde_json::from_str(json).map_err(|e| GoJsonError::Syntax(e.to_string()))?;
        Self::from_raw(raw)
    }

    /// Like [`GoObject::parse`] for an already isolated raw value.
    pub fn from_raw(raw: &'a RawValue) -> Result<Option<Self>, GoJsonError> {
        match kind(raw) {
            "null" => Ok(None),
            "object" => {
                let mut de = serde_json::Deserializer::from_str(raw.get());
                let members = de
                    .deserialize_map(MembersVisitor)
                    .map_err(|e| GoJsonError::Syntax(e.to_string()))?;
                Ok(Some(GoObject { members }))
            }
            found => Err(GoJsonError::NotAnObject { found }),
        }
    }

    /// Every value whose key matches `field` under Go's case folding, in document order.
    /// Decoders apply them in turn, so the last one wins.
    pub fn values<'s>(&'s self, field: &'s str) -> impl Iterator<Item = &'a RawValue> + 's {
        let folded = fold(field);
        self.members
            .iter()
            .filter(move |(key, _)| fold(key) == folded)
            .map(|(_, value)| *value)
    }

    /// Decodes every occurrence of `field` with `decode` and returns the last non-`None` result.
    /// `None` when the field is absent or only `null`.
    pub fn last<T>(
        &self,
        field: &str,
        decode: impl Fn(&str, &RawValue) -> Result<Option<T>, GoJsonError>,
    ) -> Result<Option<T>, GoJsonError> {
        let mut out = None;
        for raw in self.values(field) {
            if let Some(v) = decode(field, raw)? {
                out = Some(v);
            }
        }
        Ok(out)
    }
}

struct MembersVisitor;

impl<'de> Visitor<'de> for MembersVisitor {
    type Value = Vec<(String, &'de RawValue)>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let value: &'de RawValue = map.next_value()?;
            members.push((key, value));
        }
        Ok(members)
    }
}

/// The JSON kind of a raw value: `null`, `bool`, `number`, `string`, `array` or `object`.
pub fn kind(raw: &RawValue) -> &'static str {
    match raw.get().as_bytes().first() {
        Some(b'n') => "null",
        Some(b't' | b'f') => "bool",
        Some(b'"') => "string",
        Some(b'[') => "array",
        Some(b'{') => "object",
        _ => "number",
    }
}

/// Go's key folding (`encoding/json` `foldName`): ASCII letters upper-cased, other characters
/// mapped through lower case then upper case (so the Kelvin sign matches `k`).
pub fn fold(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii() {
                c.to_ascii_uppercase()
            } else {
                simple_upper(simple_lower(c))
            }
        })
        .collect()
}

fn simple_lower(c: char) -> char {
    let mut it = c.to_lowercase();
    match (it.next(), it.next()) {
        (Some(l), None) => l,
        _ => c,
    }
}

fn simple_upper(c: char) -> char {
    let mut it = c.to_uppercase();
    match (it.next(), it.next()) {
        (Some(u), None) => u,
        _ => c,
    }
}

/// A Go `string` field: `null` → `None`, a JSON string → its value, anything else an error.
pub fn string(field: &str, raw: &RawValue) -> Result<Option<String>, GoJsonError> {
    match kind(raw) {
        "null" => Ok(None),
        "string" => serde_json::from_str(raw.get())
            .map(Some)
            .map_err(|_| GoJsonError::field(field, raw, "string")),
        _ => Err(GoJsonError::field(field, raw, "string")),
    }
}

/// A Go `bool` field: only `true`/`false` (and `null` → `None`).
pub fn boolean(field: &str, raw: &RawValue) -> Result<Option<bool>, GoJsonError> {
    match raw.get() {
        "null" => Ok(None),
        "true" => Ok(Some(true)),
        "false" => Ok(Some(false)),
        _ => Err(GoJsonError::field(field, raw, "bool")),
    }
}

/// A Go `uint` field: the literal must be decimal digits fitting 64 bits (`strconv.ParseUint`).
pub fn uint(field: &str, raw: &RawValue) -> Result<Option<u64>, GoJsonError> {
    let text = raw.get();
    if text == "null" {
        return Ok(None);
    }
    if kind(raw) != "number" || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(GoJsonError::field(field, raw, "uint"));
    }
    text.parse()
        .map(Some)
        .map_err(|_| GoJsonError::field(field, raw, "uint"))
}

/// A Go `int` field: an optional `-` and decimal digits fitting 64 bits (`strconv.ParseInt`).
pub fn int(field: &str, raw: &RawValue) -> Result<Option<i64>, GoJsonError> {
    let text = raw.get();
    if text == "null" {
        return Ok(None);
    }
    let digits = text.strip_prefix('-').unwrap_or(text);
    if kind(raw) != "number" || digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(GoJsonError::field(field, raw, "int"));
    }
    text.parse()
        .map(Some)
        .map_err(|_| GoJsonError::field(field, raw, "int"))
}

/// Compacts valid JSON text the way `json.Marshal` re-emits a `json.RawMessage`: whitespace
/// outside strings removed, and `<`, `>`, `&`, U+2028 and U+2029 inside strings escaped as
/// `\u003c`, `\u003e`, `\u0026`, `\u2028`, `\u2029`. The input must be valid JSON.
pub fn compact(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    let mut in_string = false;
    let mut escaped = false;
    for c in json.chars() {
        if in_string {
            if escaped {
                escaped = false;
                out.push(c);
                continue;
            }
            match c {
                '\\' => {
                    escaped = true;
                    out.push(c);
                }
                '"' => {
                    in_string = false;
                    out.push(c);
                }
                c => push_html_safe(&mut out, c),
            }
        } else {
            match c {
                ' ' | '\t' | '\n' | '\r' => {}
                '"' => {
                    in_string = true;
                    out.push(c);
                }
                c => out.push(c),
            }
        }
    }
    out
}

fn push_html_safe(out: &mut String, c: char) {
    match c {
        '<' => out.push_str("\\u003c"),
        '>' => out.push_str("\\u003e"),
        '&' => out.push_str("\\u0026"),
        '\u{2028}' => out.push_str("\\u2028"),
        '\u{2029}' => out.push_str("\\u2029"),
        c => out.push(c),
    }
}

/// Appends `s` as a JSON string literal exactly as Go's `json.Marshal` writes it (HTML-safe
/// escaping, `\b`/`\f`/`\n`/`\r`/`\t` short escapes, other control characters as `\u00XX`).
pub fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => push_html_safe(out, c),
        }
    }
    out.push('"');
}

/// A JSON value kept verbatim (Go `json.RawMessage`), stored compacted the way Go re-emits it
/// ([`compact`]), so values written by upstream round-trip byte for byte.
#[derive(Clone)]
pub struct RawJson(Box<RawValue>);

impl RawJson {
    /// Validates `json` and stores it compacted. Surrounding whitespace is allowed.
    pub fn from_json(json: &str) -> Result<Self, GoJsonError> {
        let raw: &RawValue =
            serde_json::from_str(json).map_err(|e| GoJsonError::Syntax(e.to_string()))?;
        Ok(Self::from_raw(raw))
    }

    /// Stores an already validated raw value, compacted.
    pub fn from_raw(raw: &RawValue) -> Self {
        let compacted = compact(raw.get());
        match RawValue::from_string(compacted) {
            Ok(v) => RawJson(v),
            // Compacting valid JSON yields valid JSON; keep the original if that ever fails.
            Err(_) => RawJson(raw.to_owned()),
        }
    }

    /// The JSON literal `null`.
    pub fn null() -> Self {
        Self::from_raw(RawValue::NULL)
    }

    /// The compact JSON text.
    pub fn as_str(&self) -> &str {
        self.0.get()
    }

    /// The value as a `serde_json` raw value.
    pub fn as_raw(&self) -> &RawValue {
        &self.0
    }

    /// True for the literal `null`.
    pub fn is_null(&self) -> bool {
        self.as_str() == "null"
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for RawJson {}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn obj(json: &str) -> GoObject<'_> {
        GoObject::parse(json).unwrap().unwrap()
    }

    #[test]
    fn keys_fold_case_insensitively_and_last_duplicate_wins() {
        let o = obj(r#"{"network":"a","Network":"b","NETWORK":"c","other":1}"#);
        let v = o.last("Network", string).unwrap();
        assert_eq!(v.as_deref(), Some("c"));
        // Kelvin sign folds to K; long s folds to S.
        let o = obj("{\"\u{212a}ey\":\"k\",\"\u{17f}ubnet\":\"s\"}");
        assert_eq!(o.last("Key", string).unwrap().as_deref(), Some("k"));
        assert_eq!(o.last("subnet", string).unwrap().as_deref(), Some("s"));
    }

    #[test]
    fn null_leaves_the_previous_value() {
        let o = obj(r#"{"EnableIPv4":false,"enableipv4":null}"#);
        assert_eq!(o.last("EnableIPv4", boolean).unwrap(), Some(false));
    }

    #[test]
    fn an_invalid_earlier_duplicate_is_still_an_error() {
        let o = obj(r#"{"SubnetLen":"24","SubnetLen":24}"#);
        let err = o.last("SubnetLen", uint).unwrap_err();
        assert_eq!(
            err.to_string(),
            "field \"SubnetLen\": cannot use \"24\" as uint"
        );
    }

    #[test]
    fn integers_follow_strconv() {
        let o = obj(r#"{"a":24,"b":24.0,"c":2.4e1,"d":-1,"e":18446744073709551616}"#);
        assert_eq!(o.last("a", uint).unwrap(), Some(24));
        assert!(o.last("b", uint).is_err());
        assert!(o.last("c", uint).is_err());
        assert!(o.last("d", uint).is_err());
        assert_eq!(o.last("d", int).unwrap(), Some(-1));
        assert!(o.last("e", uint).is_err());
        assert!(o.last("b", int).is_err());
    }

    #[test]
    fn top_level_kinds() {
        assert!(GoObject::parse("null").unwrap().is_none());
        assert_eq!(
            GoObject::parse("[1]").unwrap_err(),
            GoJsonError::NotAnObject { found: "array" }
        );
        assert!(matches!(
            GoObject::parse("{").unwrap_err(),
            GoJsonError::Syntax(_)
        ));
        assert!(matches!(
            GoObject::parse("{} x").unwrap_err(),
            GoJsonError::Syntax(_)
        ));
    }

    #[test]
    fn compact_matches_go_marshal_of_raw_message() {
        assert_eq!(
            compact("{ \"VNI\" : 1,\n \"VtepMAC\": \"a b\" }"),
            r#"{"VNI":1,"VtepMAC":"a b"}"#
        );
        assert_eq!(
            compact(r#"["<a>&\"x\\", 1.50e3]"#),
            r#"["\u003ca\u003e\u0026\"x\\",1.50e3]"#
        );
        assert_eq!(compact("\"\u{2028}\""), "\"\\u2028\"");
    }

    #[test]
    fn raw_json_is_stored_compacted() {
        let r = RawJson::from_json(" { \"VNI\" : 1 } ").unwrap();
        assert_eq!(r.as_str(), r#"{"VNI":1}"#);
        assert!(RawJson::null().is_null());
        assert!(RawJson::from_json("{").is_err());
        assert!(RawJson::from_json("").is_err());
    }

    #[test]
    fn strings_are_written_like_go() {
        let mut s = String::new();
        write_string(&mut s, "a\"b\\c\n\u{1}<&>\u{8}\u{c}é");
        assert_eq!(s, r#""a\"b\\c\n\u0001\u003c\u0026\u003e\b\fé""#);
    }
}
