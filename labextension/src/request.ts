import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/**
 * The one way the browser calls the server extension: `/nbtrain/api/<endPoint>`, with the
 * server's auth token and XSRF cookie handled by ServerConnection. JSON comes back parsed; an
 * image (a scaling report's figure) comes back as a Blob.
 */
export async function requestAPI<T>(
  endPoint: string,
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, 'nbtrain', 'api', endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  const type = response.headers.get('Content-Type') ?? '';
  if (response.ok && type.startsWith('image/')) {
    return (await response.blob()) as T;
  }
  const text = await response.text();
  let data: any = text;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch {
      // not JSON (an HTML error page from a proxy): keep the text for the message
    }
  }
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response, data?.message || text);
  }
  return data as T;
}
