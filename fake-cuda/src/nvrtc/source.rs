//! Reading CUDA C++ source as far as the fake needs it: the entry points (`extern "C"
//! __global__` functions with a body) with their launch bounds and parameters, and the types the
//! source defines (`typedef`s, `struct`s) so that parameters can be sized.
//!
//! This is no compiler: function bodies are skipped unread, preprocessor lines (`#include`,
//! `#define`, `#pragma`) are ignored, so headers need not exist and macros are not expanded.
//! What is checked is what a launch depends on: at least one entry point, a `void` result,
//! balanced brackets in the declarations read, distinct entry names. A `__global__` function
//! without `extern "C"` has a mangled name `cuModuleGetFunction` cannot find by its plain
//! name: it is not an entry point here.

use super::types::{Types, normalise};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Word,
    Str,
    Punct,
}

#[derive(Debug, Clone)]
struct Token {
    kind: Kind,
    text: String,
    line: usize,
}

impl Token {
    fn is(&self, text: &str) -> bool {
        self.kind != Kind::Str && self.text == text
    }

    fn word(&self) -> Option<&str> {
        (self.kind == Kind::Word).then_some(self.text.as_str())
    }
}

/// Splits `source` into words (identifiers and numbers, `a::b` kept whole), string and
/// character literals, and single punctuation characters; comments and preprocessor lines
/// dropped.
fn tokens(source: &str) -> Vec<Token> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let mut line_start = true;
    let word_char = |c: char| c.is_ascii_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            line_start = true;
            i += 1;
            continue;
        }
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if c == '#' && line_start {
            // A directive, with its continuation lines.
            while i < chars.len() && chars[i] != '\n' {
                if chars[i] == '\\' && chars.get(i + 1) == Some(&'\n') {
                    line += 1;
                    i += 1;
                }
                i += 1;
            }
            continue;
        }
        line_start = false;
        if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if c == '/' && chars.get(i + 1) == Some(&'*') {
            i += 2;
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                if chars[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 2;
            continue;
        }
        if c == '"' || c == '\'' {
            let start = i + 1;
            i += 1;
            while i < chars.len() && chars[i] != c {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            let end = i.min(chars.len());
            out.push(Token {
                kind: Kind::Str,
                text: chars[start..end].iter().collect(),
                line,
            });
            i += 1;
            continue;
        }
        if word_char(c) {
            let start = i;
            loop {
                while i < chars.len() && word_char(chars[i]) {
                    i += 1;
                }
                // `ns::name` is one word.
                if chars.get(i) == Some(&':')
                    && chars.get(i + 1) == Some(&':')
                    && chars.get(i + 2).is_some_and(|c| word_char(*c))
                {
                    i += 2;
                    continue;
                }
                break;
            }
            out.push(Token {
                kind: Kind::Word,
                text: chars[start..i].iter().collect(),
                line,
            });
            continue;
        }
        out.push(Token {
            kind: Kind::Punct,
            text: c.to_string(),
            line,
        });
        i += 1;
    }
    out
}

/// A parameter as declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParamDecl {
    /// `[const] T* [__restrict__] name`: `const_pointee` when the pointed-at type is const.
    Pointer {
        name: String,
        pointee: String,
        const_pointee: bool,
    },
    /// A parameter passed by value (a scalar, a structure).
    Value { name: String, ty: String },
}

/// An entry point as declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryDecl {
    pub name: String,
    /// `__launch_bounds__(n)`: the most threads a block of it may have.
    pub max_threads: Option<u32>,
    pub params: Vec<ParamDecl>,
}

/// What a source declares.
#[derive(Debug, Default)]
pub struct Declarations {
    pub entries: Vec<EntryDecl>,
    pub types: Types,
}

/// A compile error: NVRTC-style log lines.
pub type Log = Vec<String>;

/// The index of the bracket closing the one at `open`.
fn closing(tokens: &[Token], open: usize) -> Option<usize> {
    let (o, c) = match tokens[open].text.as_str() {
        "(" => ("(", ")"),
        "{" => ("{", "}"),
        "[" => ("[", "]"),
        "<" => ("<", ">"),
        _ => return None,
    };
    let mut depth = 0usize;
    for (i, token) in tokens.iter().enumerate().skip(open) {
        if token.is(o) {
            depth += 1;
        } else if token.is(c) {
            depth -= 1;
            if depth == 0 {
                return Some(i);
            }
        }
    }
    None
}

/// Splits `tokens` at commas outside brackets.
fn split_commas(tokens: &[Token]) -> Vec<&[Token]> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, token) in tokens.iter().enumerate() {
        match token.text.as_str() {
            _ if token.kind == Kind::Str => {}
            "(" | "[" | "<" | "{" => depth += 1,
            ")" | "]" | ">" | "}" => depth -= 1,
            "," if depth == 0 => {
                parts.push(&tokens[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&tokens[start..]);
    parts
}

const TYPE_WORDS: [&str; 12] = [
    "const",
    "volatile",
    "unsigned",
    "signed",
    "int",
    "long",
    "short",
    "char",
    "__restrict__",
    "__restrict",
    "restrict",
    "__grid_constant__",
];

fn param(tokens: &[Token], index: usize) -> ParamDecl {
    let star = tokens.iter().position(|t| t.is("*") || t.is("&"));
    // The name: the last word, when something comes before it and it is not part of the type.
    let last_word = tokens
        .iter()
        .rposition(|t| t.kind == Kind::Word)
        .filter(|at| *at > 0 && !TYPE_WORDS.contains(&tokens[*at].text.as_str()));
    let name = match last_word {
        Some(at) if star.is_none_or(|s| at > s) => tokens[at].text.clone(),
        _ => format!("param_{index}"),
    };
    let named_at = last_word.filter(|at| tokens[*at].text == name);
    match star {
        Some(star) => {
            let words: Vec<&str> = tokens[..star].iter().filter_map(Token::word).collect();
            ParamDecl::Pointer {
                name,
                pointee: normalise(&words),
                const_pointee: words.contains(&"const"),
            }
        }
        None => {
            let words: Vec<&str> = tokens
                .iter()
                .enumerate()
                .filter(|(i, _)| Some(*i) != named_at)
                .filter_map(|(_, t)| t.word())
                .collect();
            ParamDecl::Value {
                name,
                ty: normalise(&words),
            }
        }
    }
}

/// Attributes with arguments a `__global__` declaration may carry before its name.
const ATTRIBUTES: [&str; 5] = [
    "__launch_bounds__",
    "__cluster_dims__",
    "__maxnreg__",
    "__attribute__",
    "__declspec",
];

/// The first integer of an attribute's arguments (`__launch_bounds__(256, 1)` -> 256).
fn first_number(tokens: &[Token]) -> Option<u32> {
    tokens.iter().find_map(|t| {
        t.word()
            .and_then(|w| w.trim_end_matches(['u', 'U']).parse().ok())
    })
}

/// Reads the declaration after `__global__` at `at`: an entry point when it has a body.
/// Returns it (or `None` for a prototype) and the index after its parameter list.
fn entry(tokens: &[Token], at: usize) -> Result<(Option<EntryDecl>, usize), String> {
    let mut i = at + 1;
    let mut head: Vec<&str> = Vec::new();
    let mut max_threads = None;
    let open = loop {
        let Some(token) = tokens.get(i) else {
            return Err("expected a parameter list after __global__".into());
        };
        if token.is("(") {
            break i;
        }
        if let Some(word) = token.word()
            && ATTRIBUTES.contains(&word)
            && tokens.get(i + 1).is_some_and(|t| t.is("("))
        {
            // An attribute with arguments: __launch_bounds__(..), __cluster_dims__(..), ...
            let close = closing(tokens, i + 1).ok_or(format!("unbalanced '(' after {word}"))?;
            if word == "__launch_bounds__" {
                max_threads = first_number(&tokens[i + 2..close]);
            }
            i = close + 1;
            continue;
        }
        match token.word() {
            Some(word) => head.push(word),
            None if token.is("*") || token.is("&") => {
                return Err("a __global__ function must return void".into());
            }
            None => {
                return Err(format!(
                    "unexpected '{}' in a __global__ declaration",
                    token.text
                ));
            }
        }
        i += 1;
    };
    let Some((name, result)) = head.split_last() else {
        return Err("a __global__ function without a name".into());
    };
    if !result.contains(&"void") {
        return Err(format!("__global__ function `{name}` must return void"));
    }
    let close = closing(tokens, open).ok_or(format!("unbalanced '(' in `{name}`'s parameters"))?;
    let inner = &tokens[open + 1..close];
    let params = if inner.is_empty() || (inner.len() == 1 && inner[0].is("void")) {
        Vec::new()
    } else {
        split_commas(inner)
            .into_iter()
            .enumerate()
            .map(|(index, tokens)| {
                if tokens.is_empty() {
                    Err(format!("an empty parameter in `{name}`"))
                } else {
                    Ok(param(tokens, index))
                }
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    // A body makes it a definition; anything else (`;`) a prototype.
    let defined = tokens[close + 1..]
        .iter()
        .find(|t| !(t.kind == Kind::Word && t.text.starts_with("__")))
        .is_some_and(|t| t.is("{"));
    let entry = defined.then(|| EntryDecl {
        name: name.to_string(),
        max_threads,
        params,
    });
    Ok((entry, close + 1))
}

/// `struct [__align__(n)] name { type field[count]; ... };` at `at` (the `struct` word):
/// registered in `types` when every field can be sized. Returns the index after it.
fn structure(tokens: &[Token], at: usize, types: &mut Types) -> usize {
    let mut i = at + 1;
    let mut align = None;
    if tokens.get(i).is_some_and(|t| t.is("__align__"))
        && tokens.get(i + 1).is_some_and(|t| t.is("("))
    {
        let Some(close) = closing(tokens, i + 1) else {
            return i + 1;
        };
        align = first_number(&tokens[i + 2..close]).map(u64::from);
        i = close + 1;
    }
    let Some(name) = tokens.get(i).and_then(Token::word).map(str::to_string) else {
        return i;
    };
    if !tokens.get(i + 1).is_some_and(|t| t.is("{")) {
        return i + 1;
    }
    let Some(close) = closing(tokens, i + 1) else {
        return i + 1;
    };
    let mut fields = Vec::new();
    let mut complete = true;
    for decl in tokens[i + 2..close].split(|t| t.is(";")) {
        if decl.is_empty() {
            continue;
        }
        // Methods, nested bodies, bit fields: not a plain layout.
        if decl
            .iter()
            .any(|t| t.is("(") || t.is("{") || t.is(":") || t.is("*"))
        {
            complete = false;
            break;
        }
        let (decl, count) = match decl.iter().position(|t| t.is("[")) {
            Some(open) => {
                let count = first_number(&decl[open..]).map(u64::from);
                match count {
                    Some(count) => (&decl[..open], count),
                    None => {
                        complete = false;
                        break;
                    }
                }
            }
            None => (decl, 1),
        };
        let words: Vec<&str> = decl.iter().filter_map(Token::word).collect();
        let Some((field, ty)) = words.split_last() else {
            complete = false;
            break;
        };
        fields.push((normalise(ty), field.to_string(), count));
    }
    if complete {
        types.define_struct(&name, align, &fields);
    }
    close + 1
}

/// `typedef <type> <name>;` at `at`. Returns the index after it.
fn typedef(tokens: &[Token], at: usize, types: &mut Types) -> usize {
    let Some(end) = tokens[at..].iter().position(|t| t.is(";")).map(|p| at + p) else {
        return tokens.len();
    };
    let decl = &tokens[at + 1..end];
    if decl.iter().all(|t| t.kind == Kind::Word)
        && let Some((name, target)) = decl.split_last()
    {
        let target: Vec<&str> = target.iter().map(|t| t.text.as_str()).collect();
        types.typedef(&name.text, &normalise(&target));
    }
    end + 1
}

/// Reads `source`: its entry points and types, or a compile error's log.
pub fn declarations(source: &str, file: &str) -> Result<Declarations, Log> {
    let tokens = tokens(source);
    let mut out = Declarations::default();
    let mut log = Vec::new();
    let mut depth = 0i64;
    let mut extern_c = false;
    let mut i = 0;
    while i < tokens.len() {
        let token = &tokens[i];
        match token.text.as_str() {
            _ if token.kind == Kind::Str => {}
            "{" => depth += 1,
            "}" => depth -= 1,
            "typedef" if depth == 0 => {
                i = typedef(&tokens, i, &mut out.types);
                continue;
            }
            "struct" if depth == 0 => {
                i = structure(&tokens, i, &mut out.types);
                continue;
            }
            "extern"
                if tokens
                    .get(i + 1)
                    .is_some_and(|t| t.kind == Kind::Str && t.text == "C") =>
            {
                extern_c = true;
                i += 2;
                continue;
            }
            "__global__" if depth == 0 => {
                let c_linkage = extern_c;
                match entry(&tokens, i) {
                    Ok((Some(entry), next)) => {
                        if !c_linkage {
                            // Mangled: not found by its plain name.
                        } else if out.entries.iter().any(|e| e.name == entry.name) {
                            log.push(format!(
                                "{file}({}): error: function \"{}\" has already been defined",
                                token.line, entry.name
                            ));
                        } else {
                            out.entries.push(entry);
                        }
                        extern_c = false;
                        i = next;
                        continue;
                    }
                    Ok((None, next)) => {
                        extern_c = false;
                        i = next;
                        continue;
                    }
                    Err(what) => {
                        log.push(format!("{file}({}): error: {what}", token.line));
                        break;
                    }
                }
            }
            ";" => extern_c = false,
            _ => {}
        }
        if token.is("{") || token.is("}") {
            extern_c = false;
        }
        i += 1;
    }
    if depth != 0 && log.is_empty() {
        log.push(format!(
            "{file}: error: unbalanced braces ({depth} left open)"
        ));
    }
    if out.entries.is_empty() && log.is_empty() {
        log.push(format!(
            "{file}: error: no entry point: the source defines no `extern \"C\" __global__` function"
        ));
    }
    if log.is_empty() {
        Ok(out)
    } else {
        log.push(format!(
            "1 error detected in the compilation of \"{file}\"."
        ));
        Err(log)
    }
}
