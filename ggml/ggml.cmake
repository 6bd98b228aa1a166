# How the runtime finds ggml: the CMake package installed by the PyPI package libggml-python
# (prebuilt, or built from its sdist natively / with CUDA by ggml/install.sh), or any ggml install
# the user points CMAKE_PREFIX_PATH at. Never a copy of ggml's sources.
#
# The wheel installs under lib64/, which Debian's CMake does not search, hence the suffixes.
if (NOT DEFINED ggml_DIR)
    execute_process(
        COMMAND python3 -c "import libggml, os; print(os.path.dirname(libggml.__file__))"
        OUTPUT_VARIABLE SPECEE_LIBGGML_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if (SPECEE_LIBGGML_ROOT)
        list(APPEND CMAKE_PREFIX_PATH "${SPECEE_LIBGGML_ROOT}")
    endif()
endif()
find_package(ggml CONFIG REQUIRED PATH_SUFFIXES lib64/cmake/ggml lib/cmake/ggml)

set(SPECEE_GGML_LIBDIR "${GGML_LIB_DIR}")
message(STATUS "specee: ggml ${ggml_VERSION} from ${SPECEE_GGML_LIBDIR}")

function(specee_ggml_link target)
    target_link_libraries(${target} PUBLIC ggml::ggml)
endfunction()
