//! Programs: `nvrtcCreateProgram`, `nvrtcCompileProgram`, `nvrtcGetPTXSize`, `nvrtcGetPTX`,
//! `nvrtcGetProgramLogSize`, `nvrtcGetProgramLog`, `nvrtcDestroyProgram`.

use std::ffi::{CStr, c_char, c_int};

use super::image::{Arch, Image};
use super::{
    NVRTC_ERROR_COMPILATION, NVRTC_ERROR_INVALID_INPUT, NVRTC_ERROR_INVALID_OPTION,
    NVRTC_ERROR_INVALID_PROGRAM, NVRTC_SUCCESS, Program, metadata, nvrtc_call, nvrtc_reject,
    source,
};
use crate::state::Fake;

/// The program `handle` names, or a violation.
fn program<'a>(fake: &'a mut Fake, name: &str, handle: u64) -> Result<&'a mut Program, u32> {
    if !fake.nvrtc.programs.contains_key(&handle) {
        return Err(nvrtc_reject(
            fake,
            name,
            NVRTC_ERROR_INVALID_PROGRAM,
            format!("{handle:#x} is not a live program (never created, or destroyed)"),
        ));
    }
    Ok(fake.nvrtc.programs.get_mut(&handle).expect("checked"))
}

/// A NUL-terminated string argument, lossily as UTF-8.
unsafe fn text(ptr: *const c_char) -> String {
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcCreateProgram(
    prog: *mut *mut std::ffi::c_void,
    src: *const c_char,
    name: *const c_char,
    num_headers: c_int,
    headers: *const *const c_char,
    include_names: *const *const c_char,
) -> u32 {
    nvrtc_call("nvrtcCreateProgram", |fake| {
        const NAME: &str = "nvrtcCreateProgram";
        if prog.is_null() || src.is_null() {
            return nvrtc_reject(
                fake,
                NAME,
                NVRTC_ERROR_INVALID_INPUT,
                "a NULL program or source",
            );
        }
        if num_headers < 0 || (num_headers > 0 && (headers.is_null() || include_names.is_null())) {
            return nvrtc_reject(
                fake,
                NAME,
                NVRTC_ERROR_INVALID_INPUT,
                format!("{num_headers} headers without their arrays"),
            );
        }
        let program = Program {
            name: if name.is_null() {
                "default_program".into()
            } else {
                unsafe { text(name) }
            },
            source: unsafe { text(src) },
            image: None,
            log: String::new(),
        };
        let handle = fake.nvrtc.create(program);
        unsafe { prog.write(handle as *mut std::ffi::c_void) };
        NVRTC_SUCCESS
    })
}

/// The target of `--gpu-architecture=`/`-arch=` among `options`; `Err` names a malformed one.
fn target(options: &[String]) -> Result<Option<Arch>, String> {
    let mut target = None;
    for option in options {
        if !option.starts_with('-') {
            return Err(format!("`{option}` is not an option"));
        }
        let value = option
            .strip_prefix("--gpu-architecture=")
            .or_else(|| option.strip_prefix("-arch="));
        if let Some(value) = value {
            target = Some(
                Arch::parse(value).ok_or_else(|| format!("`{option}`: no such architecture"))?,
            );
        }
    }
    Ok(target)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcCompileProgram(
    prog: *mut std::ffi::c_void,
    num_options: c_int,
    options: *const *const c_char,
) -> u32 {
    nvrtc_call("nvrtcCompileProgram", |fake| {
        const NAME: &str = "nvrtcCompileProgram";
        tri!(program(fake, NAME, prog as u64));
        if num_options < 0 || (num_options > 0 && options.is_null()) {
            return nvrtc_reject(
                fake,
                NAME,
                NVRTC_ERROR_INVALID_INPUT,
                format!("{num_options} options without their array"),
            );
        }
        let mut texts = Vec::with_capacity(num_options as usize);
        for i in 0..num_options as usize {
            let option = unsafe { options.add(i).read() };
            if option.is_null() {
                return nvrtc_reject(fake, NAME, NVRTC_ERROR_INVALID_INPUT, "a NULL option");
            }
            texts.push(unsafe { text(option) });
        }
        let target = match target(&texts) {
            Ok(target) => target,
            Err(what) => return nvrtc_reject(fake, NAME, NVRTC_ERROR_INVALID_OPTION, what),
        };
        let program = fake
            .nvrtc
            .programs
            .get_mut(&(prog as u64))
            .expect("checked");
        program.image = None;
        match source::declarations(&program.source, &program.name) {
            Ok(declarations) => {
                let image = Image {
                    target,
                    entries: declarations
                        .entries
                        .iter()
                        .map(|entry| metadata::entry(entry, &declarations.types))
                        .collect(),
                };
                program.image = Some(image.write());
                program.log.clear();
                NVRTC_SUCCESS
            }
            Err(log) => {
                program.log = log.join("\n") + "\n";
                NVRTC_ERROR_COMPILATION
            }
        }
    })
}

/// The image of a compiled program, or a violation.
fn compiled(fake: &mut Fake, name: &str, handle: u64) -> Result<String, u32> {
    let program = program(fake, name, handle)?;
    match &program.image {
        Some(image) => Ok(image.clone()),
        None => Err(nvrtc_reject(
            fake,
            name,
            NVRTC_ERROR_INVALID_PROGRAM,
            "the program has not compiled successfully",
        )),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetPTXSize(prog: *mut std::ffi::c_void, size: *mut usize) -> u32 {
    nvrtc_call("nvrtcGetPTXSize", |fake| {
        let image = tri!(compiled(fake, "nvrtcGetPTXSize", prog as u64));
        if size.is_null() {
            return nvrtc_reject(
                fake,
                "nvrtcGetPTXSize",
                NVRTC_ERROR_INVALID_INPUT,
                "a NULL size",
            );
        }
        unsafe { size.write(image.len() + 1) };
        NVRTC_SUCCESS
    })
}

/// Copies `text` and a NUL to `out`, which the caller sized with the matching `...Size` call.
unsafe fn write_with_nul(text: &str, out: *mut c_char) {
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, out, text.len());
        out.add(text.len()).write(0);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetPTX(prog: *mut std::ffi::c_void, ptx: *mut c_char) -> u32 {
    nvrtc_call("nvrtcGetPTX", |fake| {
        let image = tri!(compiled(fake, "nvrtcGetPTX", prog as u64));
        if ptx.is_null() {
            return nvrtc_reject(
                fake,
                "nvrtcGetPTX",
                NVRTC_ERROR_INVALID_INPUT,
                "a NULL buffer",
            );
        }
        unsafe { write_with_nul(&image, ptx) };
        NVRTC_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetProgramLogSize(
    prog: *mut std::ffi::c_void,
    size: *mut usize,
) -> u32 {
    nvrtc_call("nvrtcGetProgramLogSize", |fake| {
        let log = tri!(program(fake, "nvrtcGetProgramLogSize", prog as u64))
            .log
            .len();
        if size.is_null() {
            return nvrtc_reject(
                fake,
                "nvrtcGetProgramLogSize",
                NVRTC_ERROR_INVALID_INPUT,
                "a NULL size",
            );
        }
        unsafe { size.write(log + 1) };
        NVRTC_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetProgramLog(prog: *mut std::ffi::c_void, log: *mut c_char) -> u32 {
    nvrtc_call("nvrtcGetProgramLog", |fake| {
        let text = tri!(program(fake, "nvrtcGetProgramLog", prog as u64))
            .log
            .clone();
        if log.is_null() {
            return nvrtc_reject(
                fake,
                "nvrtcGetProgramLog",
                NVRTC_ERROR_INVALID_INPUT,
                "a NULL buffer",
            );
        }
        unsafe { write_with_nul(&text, log) };
        NVRTC_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcDestroyProgram(prog: *mut *mut std::ffi::c_void) -> u32 {
    nvrtc_call("nvrtcDestroyProgram", |fake| {
        if prog.is_null() {
            return nvrtc_reject(
                fake,
                "nvrtcDestroyProgram",
                NVRTC_ERROR_INVALID_PROGRAM,
                "a NULL program pointer",
            );
        }
        let handle = unsafe { prog.read() } as u64;
        tri!(program(fake, "nvrtcDestroyProgram", handle));
        fake.nvrtc.programs.remove(&handle);
        unsafe { prog.write(std::ptr::null_mut()) };
        NVRTC_SUCCESS
    })
}
