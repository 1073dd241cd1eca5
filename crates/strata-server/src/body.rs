//! Reading request bodies: size limits, JSON with the failing field named, and the JSON
//! answers for unknown routes and methods (shared by the workers and the router).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::error::ApiError;

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!("no route {}", uri.path()),
    )
}

pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} is not allowed on {}", method, uri.path()),
    )
}

pub fn parse<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    limit: usize,
) -> Result<T, ApiError> {
    parse_json(&body_bytes(body, limit)?)
}

/// The body's bytes, or a JSON 413 / 400.
pub fn body_bytes(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body exceeds the limit of {limit} bytes"),
            )
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"), None)
        }
    })
}

/// A JSON body, which is an object (serde would also take a struct's fields as an array, in
/// order, past every check by name); the error names the field at fault.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if !bytes.trim_ascii_start().starts_with(b"{") {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
            None,
        ));
    }
    no_duplicate_keys(bytes)?;
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let v = serde_path_to_error::deserialize(&mut *de)
        .map_err(|e| invalid(e, || failing_sampling_field(bytes)))?;
    // One object, nothing after it but white space (a second object would be dropped unseen).
    de.end().map_err(|e| {
        ApiError::bad_request(format!("invalid request body: after the object: {e}"), None)
    })?;
    Ok(v)
}

/// Refuses a body in which an object has a key twice, at any depth (`{"42": 100, "42":
/// -100}` in `logit_bias`, two `type`s in a schema): serde keeps the last one silently, where
/// a struct's own fields are refused. The 400 names the place. Malformed JSON passes here (the
/// body's own parse reports it).
pub(crate) fn no_duplicate_keys(bytes: &[u8]) -> Result<(), ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, Unique>(de) {
        Err(e) if e.inner().to_string().starts_with(DUPLICATE) => {
            let m = e.inner().to_string();
            let key = m.split('`').nth(1).unwrap_or_default().to_string();
            // The object's place; at the top, the key itself.
            let path = e.path().to_string();
            let param = Some(if path == "." { key } else { path });
            Err(ApiError::bad_request(
                format!("invalid request body: {}", e.inner()),
                param.as_deref(),
            ))
        }
        _ => Ok(()),
    }
}

const DUPLICATE: &str = "a key given twice";

/// Any JSON value, read only to find a key given twice in one of its objects.
struct Unique;

impl<'de> serde::Deserialize<'de> for Unique {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Unique, D::Error> {
        d.deserialize_any(UniqueVisitor)
    }
}

struct UniqueVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueVisitor {
    type Value = Unique;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Unique, E> {
        Ok(Unique)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Unique, E> {
        Ok(Unique)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Unique, E> {
        Ok(Unique)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Unique, E> {
        Ok(Unique)
    }
    fn visit_str<E>(self, _: &str) -> Result<Unique, E> {
        Ok(Unique)
    }
    fn visit_unit<E>(self) -> Result<Unique, E> {
        Ok(Unique)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Unique, A::Error> {
        while a.next_element::<Unique>()?.is_some() {}
        Ok(Unique)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Unique, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(k) = a.next_key::<String>()? {
            if seen.contains(&k) {
                return Err(serde::de::Error::custom(format!("{DUPLICATE}: `{k}`")));
            }
            a.next_value::<Unique>()?;
            seen.insert(k);
        }
        Ok(Unique)
    }
}

/// The first key of the object `o` that is not among `keys` (a key a request sent that would
/// be dropped unseen); None for a non-object.
pub(crate) fn unread_key<'a>(o: &'a Value, keys: &[&str]) -> Option<&'a str> {
    let m = o.as_object()?;
    m.keys().map(String::as_str).find(|k| !keys.contains(k))
}

/// Refuses an array where `paths` (a dotted path from the body, `[]` for every element of
/// an array there) name an object: serde reads a struct from an array of its fields in order
/// (`"stream_options": [true]`), past every check of the object's keys by name. The 400
/// names the place (`messages[2].tool_calls[0]`).
pub fn objects_at(body: &Value, paths: &[&str]) -> Result<(), ApiError> {
    for p in paths {
        let steps: Vec<&str> = p.split('.').collect();
        if let Some(at) = array_at(body, &steps) {
            return Err(ApiError::bad_request(
                format!("`{at}`: expected an object, got an array"),
                Some(&at),
            ));
        }
    }
    Ok(())
}

/// The first place below `v` that `steps` lead to and that holds an array, spelled from
/// `v` (`tool_calls[0].function`); the spelling is made only for what is found.
fn array_at(v: &Value, steps: &[&str]) -> Option<String> {
    let (step, rest) = steps.split_first()?;
    let (key, every) = match step.strip_suffix("[]") {
        Some(k) => (k, true),
        None => (*step, false),
    };
    let found = |x: &Value| match x.is_array() {
        true => Some(String::new()),
        false => array_at(x, rest).map(|t| format!(".{t}")),
    };
    match (every, v.get(key)?) {
        (true, Value::Array(a)) => a
            .iter()
            .enumerate()
            .find_map(|(i, x)| found(x).map(|t| format!("{key}[{i}]{t}"))),
        (true, _) => None, // not an array: serde names it
        (false, x) => found(x).map(|t| format!("{key}{t}")),
    }
}

/// [`parse_json`] for a body already parsed: the error names the field at fault.
pub fn from_value<T: DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| invalid(e, || None))
}

/// A body that does not deserialize: a 400 naming the field at its path (or, at the top,
/// `otherwise`'s).
fn invalid(
    e: serde_path_to_error::Error<serde_json::Error>,
    otherwise: impl FnOnce() -> Option<String>,
) -> ApiError {
    let path = e.path().to_string();
    // A field the body lacks: serde's path is the body itself; its message names it.
    let missing = || {
        let m = e.inner().to_string();
        let rest = m.strip_prefix("missing field `")?;
        rest.split('`').next().map(str::to_string)
    };
    // "." is the body itself; "?" a key serde could not read (a body cut short): the place
    // is the object holding it.
    let path = path.strip_suffix(".?").unwrap_or(&path).to_string();
    let param = if path != "." && path != "?" {
        Some(path)
    } else {
        missing().or_else(otherwise)
    };
    ApiError::bad_request(
        format!("invalid request body: {}", e.inner()),
        param.as_deref(),
    )
}

/// serde loses the path of an error inside a flattened struct (the sampling fields): the
/// field that fails on its own is the one to name.
fn failing_sampling_field(bytes: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(bytes).ok()?;
    v.as_object()?
        .iter()
        .find(|(k, val)| {
            serde_json::from_value::<crate::api::Sampling>(json!({ k.as_str(): val })).is_err()
        })
        .map(|(k, _)| k.clone())
}

/// Refuses a body in a content coding (`Content-Encoding: gzip`, ...) with a JSON 415: it
/// would be read as if it were plain JSON, never decoded. `identity` passes.
pub async fn plain_bodies(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let coded = req
        .headers()
        .get_all(axum::http::header::CONTENT_ENCODING)
        .iter()
        .find(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if let Some(v) = coded {
        let msg = format!(
            "Content-Encoding `{}` is not taken: send the body as it is",
            String::from_utf8_lossy(v.as_bytes())
        );
        return ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            msg,
        )
        .into_response();
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body is an object: serde's array form of a struct (its fields in order, which the
    /// field checks by name never see) is refused.
    #[test]
    fn a_body_is_an_object() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        struct B {
            input: String,
        }
        assert_eq!(
            parse_json::<B>(b" \n{\"input\": \"hi\"}").unwrap().input,
            "hi"
        );
        for bad in [&b"[\"hi\"]"[..], b"\"hi\"", b"null", b""] {
            let e = parse_json::<B>(bad).unwrap_err().body();
            assert_eq!(
                e["error"]["message"],
                "the request body must be a JSON object"
            );
        }
        // Nothing after the object but white space: a second object is not dropped unseen.
        assert_eq!(
            parse_json::<B>(b"{\"input\": \"a\"} \r\n").unwrap().input,
            "a"
        );
        for bad in [
            &b"{\"input\": \"a\"}{\"input\": \"b\"}"[..],
            b"{\"input\": \"a\"} x",
        ] {
            let e = parse_json::<B>(bad).unwrap_err().body();
            let m = e["error"]["message"].as_str().unwrap();
            assert!(m.contains("after the object: trailing characters"), "{m}");
        }
    }

    /// A key given twice in any object is refused, naming the object (the key at the top);
    /// serde would keep the last silently (`logit_bias`, a schema's `type`).
    #[test]
    fn a_key_given_twice_is_refused_where_it_is() {
        for (body, param) in [
            (r#"{"max_tokens": 1, "max_tokens": 2}"#, "max_tokens"),
            (r#"{"logit_bias": {"42": 100, "42": -100}}"#, "logit_bias"),
            (
                r#"{"messages": [{"role": "user", "content": "a", "role": "system"}]}"#,
                "messages[0]",
            ),
            (
                r#"{"response_format": {"json_schema": {"schema": {"type": "integer", "type": "string"}}}}"#,
                "response_format.json_schema.schema",
            ),
        ] {
            let e = parse_json::<Value>(body.as_bytes()).unwrap_err().body();
            assert_eq!(e["error"]["param"], param, "{body}: {e}");
            let m = e["error"]["message"].as_str().unwrap();
            assert!(m.contains("a key given twice"), "{m}");
        }
        // A body cut short (a Content-Length shorter than what was sent): no "?" for a place.
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct M {
            messages: Vec<Value>,
        }
        for (cut, param) in [
            (
                &br#"{"messages": [{"role": "user", "#[..],
                json!("messages[0]"),
            ),
            (br#"{"messages": [], "ma"#, Value::Null),
            (br#"{"mess"#, Value::Null),
        ] {
            let e = parse_json::<M>(cut).unwrap_err().body();
            assert_eq!(e["error"]["param"], param, "{e}");
        }
        let fine = r#"{"a": {"x": 1}, "b": {"x": 2}, "c": [{"x": 1}, {"x": 2}]}"#;
        assert!(parse_json::<Value>(fine.as_bytes()).is_ok());
    }
}
